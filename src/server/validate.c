/* Body parsing and field validation for payments and orders. Every rule
 * that rejects input names the field and a stable code; the canonical
 * command keeps only what the operation means, with defaults applied. */
#include "server/validate.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "util/json_text.h"

/* Whether the number token `tok` (`len` bytes) is beyond what the parser
 * holds: an integer outside 64 bits, or a real that overflows a double. */
static int number_out_of_range(const char *tok, size_t len) {
  char small[64], *buf = small;
  int integer = memchr(tok, '.', len) == NULL && memchr(tok, 'e', len) == NULL &&
                memchr(tok, 'E', len) == NULL;
  size_t digits = len - (tok[0] == '-');
  int out;

  if (integer && digits > 40)
    return 1;
  /* A long real (a thousand digits before its point overflow a double
   * too) is read whole: the parser would call it invalid JSON (400). */
  if (len >= sizeof small && (buf = malloc(len + 1)) == NULL)
    return 0; /* the parser decides */
  memcpy(buf, tok, len);
  buf[len] = '\0';
  errno = 0;
  if (integer) {
    (void)strtoll(buf, NULL, 10);
    out = errno == ERANGE;
  } else {
    out = isinf(strtod(buf, NULL));
  }
  if (buf != small)
    free(buf);
  return out;
}

/* One pass over the body's text, outside its strings. Sets *too_deep when
 * an object or array opens deeper than IDEMD_MAX_DEPTH (the body itself is
 * depth 1), and then returns NULL at once: the parser, which recurses once
 * per level up to its own limit (2,048 in jansson), never sees such a body,
 * so a worker's stack holds at most 32 of its levels. Otherwise returns a
 * copy of the body with out-of-range numbers replaced by the
 * IDEMD_OUT_OF_RANGE markers (malloc'd, `*out_len` set), or NULL when
 * there are none (or no memory: the parser then reports the body). */
static char *scan_body(const char *body, size_t len, size_t *out_len, int *too_deep) {
  char *out = NULL;
  size_t n = 0, copied = 0;
  int in_string = 0, depth = 0;

  *too_deep = 0;

  for (size_t i = 0; i < len; i++) {
    char c = body[i];
    size_t j;
    if (in_string) {
      if (c == '\\')
        i++;
      else if (c == '"')
        in_string = 0;
      continue;
    }
    if (c == '"') {
      in_string = 1;
      continue;
    }
    if (c == '{' || c == '[') {
      if (++depth > IDEMD_MAX_DEPTH) {
        free(out);
        *too_deep = 1;
        return NULL;
      }
      continue;
    }
    if (c == '}' || c == ']') {
      depth--;
      continue;
    }
    if (c != '-' && (c < '0' || c > '9'))
      continue;
    for (j = i; j < len && body[j] && strchr("0123456789+-.eE", body[j]); j++)
      ;
    if (number_out_of_range(body + i, j - i)) {
      const char *mark = c == '-' ? "\"\\u0001-out of range\"" : "\"\\u0001out of range\"";
      size_t mlen = strlen(mark);
      char *grown = realloc(out, n + (i - copied) + mlen + (len - j) + 1);
      if (grown == NULL) {
        free(out);
        return NULL;
      }
      out = grown;
      memcpy(out + n, body + copied, i - copied);
      n += i - copied;
      memcpy(out + n, mark, mlen);
      n += mlen;
      copied = j;
    }
    i = j - 1;
  }
  if (out == NULL)
    return NULL;
  memcpy(out + n, body + copied, len - copied);
  n += len - copied;
  out[n] = '\0';
  *out_len = n;
  return out;
}

int idemd_parse_body(const char *body, size_t len, json_t **out,
                     int *out_of_range, const char **msg) {
  json_error_t err;
  json_t *v;
  size_t marked_len = 0;
  int too_deep;
  char *marked;

  *out = NULL;
  *out_of_range = 0;
  if (len == 0) {
    *msg = "request body must be a JSON object";
    return -1;
  }
  marked = scan_body(body, len, &marked_len, &too_deep);
  if (too_deep) {
    *msg = "request body nests deeper than 32 levels";
    return -1;
  }
  if (marked) {
    *out_of_range = 1;
    body = marked;
    len = marked_len;
  }
  v = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &err);
  free(marked);
  if (v == NULL) {
    switch (json_error_code(&err)) {
    case json_error_duplicate_key:
      *msg = "request body has a duplicate key";
      break;
    case json_error_invalid_utf8:
      *msg = "request body is not valid UTF-8";
      break;
    case json_error_null_character:
    case json_error_null_byte_in_key:
      *msg = "request body contains a NUL character";
      break;
    case json_error_stack_overflow: /* scan_body() stops these first */
      *msg = "request body nests deeper than 32 levels";
      break;
    default:
      *msg = "request body is not valid JSON";
    }
    return -1;
  }
  if (!json_is_object(v)) {
    json_decref(v);
    *msg = "request body must be a JSON object";
    return -1;
  }
  *out = v;
  return 0;
}

static void add_error(json_t *errors, const char *field, const char *code,
                      const char *message) {
  json_array_append_new(errors, json_pack("{s:s, s:s, s:s}", "field", field,
                                          "message", message, "code", code));
}

static int visible_ascii(const char *s, size_t len) {
  for (size_t i = 0; i < len; i++)
    if ((unsigned char)s[i] < 0x21 || (unsigned char)s[i] > 0x7e)
      return 0;
  return 1;
}

/* A positive integer in minor units: a JSON integer or a string of digits,
 * from 1 to 2^53 - 1. Returns 0 and sets `*out`, or adds an error. */
static int positive_int(const json_t *v, const char *field, json_t *errors,
                        int64_t *out) {
  if (json_is_integer(v)) {
    json_int_t n = json_integer_value(v);
    if (n <= 0) {
      add_error(errors, field, "not_positive", "must be a positive integer");
      return -1;
    }
    if (n > IDEMD_MAX_SAFE_INT) {
      add_error(errors, field, "too_large", "must be at most 9007199254740991");
      return -1;
    }
    *out = n;
    return 0;
  }
  if (json_is_string(v)) {
    const char *s = json_string_value(v);
    size_t len = json_string_length(v);
    int64_t n = 0;
    if (strcmp(s, IDEMD_OUT_OF_RANGE) == 0) {
      add_error(errors, field, "too_large", "must be at most 9007199254740991");
      return -1;
    }
    if (strcmp(s, IDEMD_OUT_OF_RANGE_NEG) == 0) {
      add_error(errors, field, "not_positive", "must be a positive integer");
      return -1;
    }
    if (len == 0 || strspn(s, "0123456789") != len) {
      add_error(errors, field, "not_integer",
                "must be a positive integer or a string of digits");
      return -1;
    }
    for (size_t i = 0; i < len; i++) {
      n = n * 10 + (s[i] - '0');
      if (n > IDEMD_MAX_SAFE_INT) {
        add_error(errors, field, "too_large", "must be at most 9007199254740991");
        return -1;
      }
    }
    if (n == 0) {
      add_error(errors, field, "not_positive", "must be a positive integer");
      return -1;
    }
    *out = n;
    return 0;
  }
  if (json_is_real(v)) {
    add_error(errors, field, "not_integer",
              "must be an integer, without a fraction or exponent");
    return -1;
  }
  add_error(errors, field, "invalid_type",
            "must be a positive integer or a string of digits");
  return -1;
}

/* An identifier: a string of 1 to `max` visible ASCII characters. */
static int identifier(const json_t *v, const char *field, size_t max,
                      json_t *errors) {
  char message[80];
  if (!json_is_string(v)) {
    add_error(errors, field, "invalid_type", "must be a string");
    return -1;
  }
  if (json_string_length(v) == 0) {
    add_error(errors, field, "empty", "must not be empty");
    return -1;
  }
  if (json_string_length(v) > max) {
    snprintf(message, sizeof message, "must be at most %zu characters", max);
    add_error(errors, field, "too_long", message);
    return -1;
  }
  if (!visible_ascii(json_string_value(v), json_string_length(v))) {
    add_error(errors, field, "invalid_format",
              "must be visible ASCII characters, without spaces");
    return -1;
  }
  return 0;
}

/* `currency`: three upper-case letters; absent or null means BRL. */
static const char *currency(const json_t *obj, json_t *errors) {
  const json_t *v = json_object_get(obj, "currency");
  const char *s;
  if (v == NULL || json_is_null(v))
    return "BRL";
  if (!json_is_string(v)) {
    add_error(errors, "currency", "invalid_type", "must be a string");
    return NULL;
  }
  s = json_string_value(v);
  if (json_string_length(v) != 3 || strspn(s, "ABCDEFGHIJKLMNOPQRSTUVWXYZ") != 3) {
    add_error(errors, "currency", "invalid_format",
              "must be three upper-case letters (ISO 4217)");
    return NULL;
  }
  return s;
}

/* Adds an error for each key of `obj` that is not in `allowed`. */
static void unknown_fields(const json_t *obj, const char *const *allowed,
                           const char *prefix, json_t *errors) {
  const char *k;
  json_t *v;
  json_object_foreach((json_t *)obj, k, v) {
    int known = 0;
    char field[300];
    for (const char *const *a = allowed; *a && !known; a++)
      known = strcmp(*a, k) == 0;
    if (known)
      continue;
    snprintf(field, sizeof field, "%s%.256s", prefix, k);
    add_error(errors, field, "unknown_field", "is not a known field");
  }
}

static int finish(json_t *cmd, json_t *errors, json_t **cmd_out,
                  json_t **errors_out) {
  if (json_array_size(errors) > 0 || cmd == NULL) {
    json_decref(cmd);
    *cmd_out = NULL;
    *errors_out = errors;
    return -1;
  }
  json_decref(errors);
  *cmd_out = cmd;
  *errors_out = NULL;
  return 0;
}

int idemd_validate_payment_cmd(const json_t *body, idemd_payment_cmd_t *cmd,
                               json_t **errors_out) {
  static const char *const allowed[] = {"amount", "currency", "order_id", NULL};
  json_t *errors = json_array();
  const json_t *v;
  const char *cur;
  int64_t amount = 0;
  int ok = 1;

  memset(cmd, 0, sizeof *cmd);
  v = json_object_get(body, "amount");
  if (v == NULL || json_is_null(v)) {
    add_error(errors, "amount", "required", "is required");
    ok = 0;
  } else if (positive_int(v, "amount", errors, &amount) != 0) {
    ok = 0;
  }
  cur = currency(body, errors);
  ok = ok && cur != NULL;
  v = json_object_get(body, "order_id");
  if (v != NULL && !json_is_null(v) &&
      identifier(v, "order_id", IDEMD_ORDER_ID_MAX, errors) != 0)
    ok = 0;
  unknown_fields(body, allowed, "", errors);

  if (!ok || json_array_size(errors) > 0) {
    *errors_out = errors;
    return -1;
  }
  json_decref(errors);
  cmd->amount = amount;
  memcpy(cmd->currency, cur, 3); /* currency() let three letters through */
  if (v != NULL && !json_is_null(v))
    memcpy(cmd->order_id, json_string_value(v), json_string_length(v));
  *errors_out = NULL;
  return 0;
}

json_t *idemd_payment_cmd_json(const idemd_payment_cmd_t *cmd) {
  json_t *out = json_pack("{s:I, s:s}", "amount", (json_int_t)cmd->amount,
                          "currency", cmd->currency);

  if (out && cmd->order_id[0] != '\0' &&
      json_object_set_new(out, "order_id", json_string(cmd->order_id)) != 0) {
    json_decref(out);
    out = NULL;
  }
  return out;
}

int idemd_validate_payment(const json_t *body, json_t **cmd_out,
                           json_t **errors_out) {
  idemd_payment_cmd_t cmd;

  *cmd_out = NULL;
  if (idemd_validate_payment_cmd(body, &cmd, errors_out) != 0)
    return -1;
  if ((*cmd_out = idemd_payment_cmd_json(&cmd)) == NULL) {
    *errors_out = json_array(); /* out of memory, as a failed json_pack() was */
    return -1;
  }
  return 0;
}

_Static_assert(IDEMD_PAYMENT_CANON_MAX >=
                   sizeof "{\"amount\":,\"currency\":,\"order_id\":}" + IDEM_JSON_INT_MAX +
                       IDEM_JSON_STRING_MAX(3) + IDEM_JSON_STRING_MAX(IDEMD_ORDER_ID_MAX),
               "IDEMD_PAYMENT_CANON_MAX holds the longest payment command");

size_t idemd_payment_canon(const idemd_payment_cmd_t *cmd, char *out) {
  size_t n = IDEM_JSON_LIT(out, "{\"amount\":");

  /* Keys in bytewise order, as idem_canon_dump() sorts them; the values
   * are what the validator let through: digits, three capital letters,
   * visible ASCII (which idem__json_string() writes as jansson does). */
  n += idem__json_int(out + n, (long long)cmd->amount);
  n += IDEM_JSON_LIT(out + n, ",\"currency\":");
  n += idem__json_string(out + n, cmd->currency);
  if (cmd->order_id[0] != '\0') {
    n += IDEM_JSON_LIT(out + n, ",\"order_id\":");
    n += idem__json_string(out + n, cmd->order_id);
  }
  out[n++] = '}';
  out[n] = '\0';
  return n;
}

int idemd_validate_order(const json_t *body, json_t **cmd_out,
                         json_t **errors_out, int64_t *total_out) {
  static const char *const allowed[] = {"customer_id", "items", "currency", NULL};
  static const char *const item_allowed[] = {"sku", "quantity", "unit_price", NULL};
  json_t *errors = json_array();
  json_t *items = json_array();
  json_t *cmd = NULL;
  const json_t *customer, *list, *it;
  const char *cur;
  int64_t total = 0;
  int ok = 1, overflow = 0;
  size_t i;

  customer = json_object_get(body, "customer_id");
  if (customer == NULL || json_is_null(customer)) {
    add_error(errors, "customer_id", "required", "is required");
    ok = 0;
  } else if (identifier(customer, "customer_id", 255, errors) != 0) {
    ok = 0;
  }

  list = json_object_get(body, "items");
  if (list == NULL || json_is_null(list)) {
    add_error(errors, "items", "required", "is required");
    ok = 0;
  } else if (!json_is_array(list)) {
    add_error(errors, "items", "invalid_type", "must be an array of items");
    ok = 0;
  } else if (json_array_size(list) == 0) {
    add_error(errors, "items", "empty", "must hold at least one item");
    ok = 0;
  } else if (json_array_size(list) > IDEMD_MAX_ITEMS) {
    add_error(errors, "items", "too_many", "must hold at most 100 items");
    ok = 0;
  } else {
    json_array_foreach(list, i, it) {
      char field[64], prefix[32];
      int64_t qty = 0, price = 0, line;
      const json_t *sku;
      int item_ok = 1;

      snprintf(prefix, sizeof prefix, "items[%zu].", i);
      if (!json_is_object(it)) {
        snprintf(field, sizeof field, "items[%zu]", i);
        add_error(errors, field, "invalid_type", "must be an object");
        ok = 0;
        continue;
      }
      sku = json_object_get(it, "sku");
      snprintf(field, sizeof field, "%ssku", prefix);
      if (sku == NULL || json_is_null(sku)) {
        add_error(errors, field, "required", "is required");
        item_ok = 0;
      } else if (identifier(sku, field, 64, errors) != 0) {
        item_ok = 0;
      }
      snprintf(field, sizeof field, "%squantity", prefix);
      if (json_object_get(it, "quantity") == NULL) {
        add_error(errors, field, "required", "is required");
        item_ok = 0;
      } else if (positive_int(json_object_get(it, "quantity"), field, errors, &qty) != 0) {
        item_ok = 0;
      }
      snprintf(field, sizeof field, "%sunit_price", prefix);
      if (json_object_get(it, "unit_price") == NULL) {
        add_error(errors, field, "required", "is required");
        item_ok = 0;
      } else if (positive_int(json_object_get(it, "unit_price"), field, errors, &price) != 0) {
        item_ok = 0;
      }
      unknown_fields(it, item_allowed, prefix, errors);
      if (!item_ok) {
        ok = 0;
        continue;
      }
      if (__builtin_mul_overflow(qty, price, &line) || line > IDEMD_MAX_SAFE_INT ||
          __builtin_add_overflow(total, line, &total) || total > IDEMD_MAX_SAFE_INT)
        overflow = 1;
      json_array_append_new(items, json_pack("{s:s, s:I, s:I}", "sku",
                                             json_string_value(sku), "quantity",
                                             (json_int_t)qty, "unit_price",
                                             (json_int_t)price));
    }
  }
  if (ok && overflow) {
    add_error(errors, "items", "too_large",
              "the order total must be at most 9007199254740991");
    ok = 0;
  }
  cur = currency(body, errors);
  ok = ok && cur != NULL;
  unknown_fields(body, allowed, "", errors);

  if (ok && json_array_size(errors) == 0)
    cmd = json_pack("{s:s, s:O, s:s}", "customer_id", json_string_value(customer),
                    "items", items, "currency", cur);
  json_decref(items);
  *total_out = cmd ? total : 0;
  return finish(cmd, errors, cmd_out, errors_out);
}

/* The parts of an order command from idemd_validate_order(), and room for
 * them written as JSON text with `extra` bytes more: the fixed text and
 * numbers take under 128 bytes for the order and under 96 per item, each
 * string at most IDEM_JSON_STRING_MAX. 0 when `cmd` is no such command. */
static size_t order_parts(const json_t *cmd, size_t extra, const char **customer,
                          const char **currency, const json_t **items) {
  const json_t *it;
  size_t cap, i;

  *customer = json_string_value(json_object_get(cmd, "customer_id"));
  *currency = json_string_value(json_object_get(cmd, "currency"));
  *items = json_object_get(cmd, "items");
  if (*customer == NULL || *currency == NULL || !json_is_array(*items))
    return 0;
  cap = 128 + extra + IDEM_JSON_STRING_MAX(strlen(*customer)) +
        IDEM_JSON_STRING_MAX(strlen(*currency));
  json_array_foreach(*items, i, it) {
    const char *sku = json_string_value(json_object_get(it, "sku"));
    if (sku == NULL || !json_is_integer(json_object_get(it, "quantity")) ||
        !json_is_integer(json_object_get(it, "unit_price")))
      return 0;
    cap += 96 + IDEM_JSON_STRING_MAX(strlen(sku));
  }
  return cap;
}

/* Writes the items of an order command as a JSON array, each with its
 * keys in the order's own order (sku, quantity, unit_price) or, `sorted`,
 * bytewise as the canonical form has them; returns the bytes written. */
static size_t write_items(char *out, const json_t *items, int sorted) {
  const json_t *it;
  size_t n = 0, i;

  out[n++] = '[';
  json_array_foreach(items, i, it) {
    const char *sku = json_string_value(json_object_get(it, "sku"));
    long long quantity = json_integer_value(json_object_get(it, "quantity"));

    if (i > 0)
      out[n++] = ',';
    if (sorted) {
      n += IDEM_JSON_LIT(out + n, "{\"quantity\":");
      n += idem__json_int(out + n, quantity);
      n += IDEM_JSON_LIT(out + n, ",\"sku\":");
      n += idem__json_string(out + n, sku);
    } else {
      n += IDEM_JSON_LIT(out + n, "{\"sku\":");
      n += idem__json_string(out + n, sku);
      n += IDEM_JSON_LIT(out + n, ",\"quantity\":");
      n += idem__json_int(out + n, quantity);
    }
    n += IDEM_JSON_LIT(out + n, ",\"unit_price\":");
    n += idem__json_int(out + n, json_integer_value(json_object_get(it, "unit_price")));
    out[n++] = '}';
  }
  out[n++] = ']';
  return n;
}

char *idemd_order_json(const json_t *cmd, const char *id, int64_t total,
                       const char *created_at) {
  const char *customer, *currency;
  const json_t *items;
  size_t cap, n = 0;
  char *out;

  cap = order_parts(cmd, IDEM_JSON_STRING_MAX(strlen(id)) +
                             IDEM_JSON_STRING_MAX(strlen(created_at)),
                    &customer, &currency, &items);
  if (cap == 0 || (out = malloc(cap)) == NULL)
    return NULL;
  n += IDEM_JSON_LIT(out + n, "{\"id\":");
  n += idem__json_string(out + n, id);
  n += IDEM_JSON_LIT(out + n, ",\"customer_id\":");
  n += idem__json_string(out + n, customer);
  n += IDEM_JSON_LIT(out + n, ",\"items\":");
  n += write_items(out + n, items, 0);
  n += IDEM_JSON_LIT(out + n, ",\"currency\":");
  n += idem__json_string(out + n, currency);
  n += IDEM_JSON_LIT(out + n, ",\"total\":");
  n += idem__json_int(out + n, (long long)total);
  n += IDEM_JSON_LIT(out + n, ",\"status\":\"created\",\"created_at\":");
  n += idem__json_string(out + n, created_at);
  out[n++] = '}';
  out[n] = '\0';
  return out;
}

char *idemd_order_canon(const json_t *cmd, size_t *len) {
  const char *customer, *currency;
  const json_t *items;
  size_t cap, n = 0;
  char *out;

  cap = order_parts(cmd, 0, &customer, &currency, &items);
  if (cap == 0 || (out = malloc(cap)) == NULL)
    return NULL;
  /* Keys in bytewise order at each level, as idem_canon_dump() sorts
   * them; the strings are visible ASCII. */
  n += IDEM_JSON_LIT(out + n, "{\"currency\":");
  n += idem__json_string(out + n, currency);
  n += IDEM_JSON_LIT(out + n, ",\"customer_id\":");
  n += idem__json_string(out + n, customer);
  n += IDEM_JSON_LIT(out + n, ",\"items\":");
  n += write_items(out + n, items, 1);
  out[n++] = '}';
  out[n] = '\0';
  *len = n;
  return out;
}
