/* The order command: validation of {"customer_id", "items", "currency"},
 * its canonical command, and the order it creates written as JSON. */
#include "server/order_cmd.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/fields.h"
#include "util/json_text.h"

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
    idemd__add_error(errors, "customer_id", "required", "is required");
    ok = 0;
  } else if (idemd__identifier(customer, "customer_id", 255, errors) != 0) {
    ok = 0;
  }

  list = json_object_get(body, "items");
  if (list == NULL || json_is_null(list)) {
    idemd__add_error(errors, "items", "required", "is required");
    ok = 0;
  } else if (!json_is_array(list)) {
    idemd__add_error(errors, "items", "invalid_type", "must be an array of items");
    ok = 0;
  } else if (json_array_size(list) == 0) {
    idemd__add_error(errors, "items", "empty", "must hold at least one item");
    ok = 0;
  } else if (json_array_size(list) > IDEMD_MAX_ITEMS) {
    idemd__add_error(errors, "items", "too_many", "must hold at most 100 items");
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
        idemd__add_error(errors, field, "invalid_type", "must be an object");
        ok = 0;
        continue;
      }
      sku = json_object_get(it, "sku");
      snprintf(field, sizeof field, "%ssku", prefix);
      if (sku == NULL || json_is_null(sku)) {
        idemd__add_error(errors, field, "required", "is required");
        item_ok = 0;
      } else if (idemd__identifier(sku, field, 64, errors) != 0) {
        item_ok = 0;
      }
      snprintf(field, sizeof field, "%squantity", prefix);
      if (json_object_get(it, "quantity") == NULL) {
        idemd__add_error(errors, field, "required", "is required");
        item_ok = 0;
      } else if (idemd__positive_int(json_object_get(it, "quantity"), field, errors, &qty) != 0) {
        item_ok = 0;
      }
      snprintf(field, sizeof field, "%sunit_price", prefix);
      if (json_object_get(it, "unit_price") == NULL) {
        idemd__add_error(errors, field, "required", "is required");
        item_ok = 0;
      } else if (idemd__positive_int(json_object_get(it, "unit_price"), field, errors, &price) != 0) {
        item_ok = 0;
      }
      idemd__unknown_fields(it, item_allowed, prefix, errors);
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
    idemd__add_error(errors, "items", "too_large",
              "the order total must be at most 9007199254740991");
    ok = 0;
  }
  cur = idemd__currency(body, errors);
  ok = ok && cur != NULL;
  idemd__unknown_fields(body, allowed, "", errors);

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
