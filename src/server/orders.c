/* The order routes that write: POST /orders, written together with its
 * idempotency record, already completed, in the one transaction that
 * reserves the key (an order has no outside effect); and the two that are
 * idempotent by design, without a key (docs/idempotency.md, section 3.5):
 * PUT /orders/{id}, whose id the client chose, decided by the unique key
 * (tenant, id), and POST /orders/{id}/cancel, which sets a state. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "idem/canon.h"
#include "idem/clock.h"
#include "idem/crypto.h"
#include "data/resources.h"
#include "server/fields.h"
#include "server/flow.h"
#include "server/reply.h"
#include "server/order_cmd.h"

#define OPERATION "create_order"

typedef struct order_call {
  json_t *cmd; /* the validated command */
  int64_t total;
  char fingerprint[IDEM_FINGERPRINT_LEN];
  char id[32], location[64];
  char *text; /* the order, made by prepare() */
  idemd_resource_t row;
  const char *request_id; /* the actor of its audit row */
  idem_outcome_t done;
  idemd_effect_t effect;
} order_call_t;

static void order_call_free(void *call) {
  order_call_t *oc = call;
  free(oc->text);
  json_decref(oc->cmd);
  free(oc);
}

/* Gives the order its id and body: only when the key is to be reserved,
 * so replays skip it. Called again when a reservation lost its race and
 * the key was free again by the next one: a new id and body. */
static int prepare(void *ctx) {
  order_call_t *oc = ctx;
  char token[25], created_at[32];
  int64_t now = idem_now_ms();

  if (idem_sortable_token(token, 24, now) != IDEM_OK)
    return IDEM_ECRYPTO;
  _Static_assert(sizeof oc->id >= 4 + sizeof token, "an order id holds ord_ and a token");
  _Static_assert(sizeof oc->location >= 8 + sizeof oc->id,
                 "a location holds /orders/ and an id");
  memcpy(oc->id, "ord_", 4);
  memcpy(oc->id + 4, token, sizeof token); /* 24 characters and the NUL */
  memcpy(oc->location, "/orders/", 8);
  memcpy(oc->location + 8, oc->id, 4 + sizeof token);
  idem_format_time(now, created_at, sizeof created_at);
  free(oc->text);
  oc->text = idemd_order_json(oc->cmd, oc->id, oc->total, created_at);
  if (oc->text == NULL)
    return IDEM_ENOMEM;
  oc->row = (idemd_resource_t){.tenant_id = oc->row.tenant_id,
                               .kind = "order",
                               .id = oc->id,
                               .status = "created",
                               .body = oc->text,
                               .who = {oc->request_id, "POST /orders"}};
  oc->done = (idem_outcome_t){.state = IDEM_STATE_COMPLETED, .status = 201,
                              .body = oc->text, .location = oc->location,
                              .resource_id = oc->id};
  return IDEM_OK;
}

enum MHD_Result idemd_orders_create(idemd_request_t *r, const json_t *body) {
  order_call_t *oc;
  json_t *cmd = NULL, *errors = NULL;
  int64_t total = 0;
  char *canon;
  size_t len;
  int rc;

  if (idemd_validate_order(body, &cmd, &errors, &total) != 0) {
    r->outcome = OUTCOME_INVALID;
    return idemd_reply_errors(r, errors);
  }
  if ((oc = calloc(1, sizeof *oc)) == NULL) {
    json_decref(cmd);
    return idemd_reply_store_error(r, IDEM_ENOMEM);
  }
  idemd_request_own(r, oc, order_call_free);
  oc->cmd = cmd;
  oc->request_id = r->request_id;
  oc->row.tenant_id = r->tenant.id;
  oc->total = total;
  canon = idemd_order_canon(cmd, &len);
  if (canon == NULL)
    return idemd_reply_store_error(r, IDEM_ENOMEM);
  rc = idem_fingerprint_text(OPERATION, canon, len, oc->fingerprint);
  free(canon);
  if (rc != IDEM_OK)
    return idemd_reply_store_error(r, rc);
  oc->effect = (idemd_effect_t){.operation = OPERATION, .fingerprint = oc->fingerprint,
                                .resource_id = oc->id,
                                .written = {idemd_resource_insert, &oc->row},
                                .outcome = &oc->done,
                                .prepare = prepare, .ctx = oc};
  return idemd_flow_run(r, &oc->effect);
}

/* ---- without a key ------------------------------------------------------ */

/* What says whether two orders hold one command: the fingerprint of the
 * canonical validated command (docs/idempotency.md, section 2.3) under
 * one name, whichever route wrote the order. */
static int command_fingerprint(const json_t *cmd, char out[IDEM_FINGERPRINT_LEN]) {
  size_t len;
  char *canon = idemd_order_canon(cmd, &len);
  int rc;

  if (canon == NULL)
    return IDEM_ENOMEM;
  rc = idem_fingerprint_text("order", canon, len, out);
  free(canon);
  return rc;
}

/* The fingerprint of the command the stored order `text` was made from:
 * its customer, items and currency validated again. IDEM_EINVAL when the
 * text holds no such order. */
static int stored_fingerprint(const char *text, char out[IDEM_FINGERPRINT_LEN]) {
  json_t *order = json_loads(text, JSON_REJECT_DUPLICATES, NULL);
  json_t *given, *cmd = NULL, *errors = NULL;
  int64_t total;
  int rc = IDEM_EINVAL;

  if (!json_is_object(order)) {
    json_decref(order);
    return IDEM_EINVAL;
  }
  given = json_pack("{s:O?, s:O?, s:O?}", "customer_id",
                    json_object_get(order, "customer_id"), "items",
                    json_object_get(order, "items"), "currency",
                    json_object_get(order, "currency"));
  if (given == NULL)
    rc = IDEM_ENOMEM;
  else if (idemd_validate_order(given, &cmd, &errors, &total) == 0)
    rc = command_fingerprint(cmd, out);
  json_decref(errors);
  json_decref(cmd);
  json_decref(given);
  json_decref(order);
  return rc;
}

enum MHD_Result idemd_orders_put(idemd_request_t *r, const json_t *body) {
  json_t *cmd = NULL, *errors = NULL;
  char created_at[32], want[IDEM_FINGERPRINT_LEN], have[IDEM_FINGERPRINT_LEN];
  char location[8 + IDEMD_PATH_ID_MAX + 1];
  char *text, *existing = NULL;
  int64_t total = 0;
  idemd_resource_t row;
  enum MHD_Result ret;
  int rc;

  if (idemd_validate_order(body, &cmd, &errors, &total) != 0) {
    r->outcome = OUTCOME_INVALID;
    return idemd_reply_errors(r, errors);
  }
  idem_format_time(idem_now_ms(), created_at, sizeof created_at);
  text = idemd_order_json(cmd, r->resource_id, total, created_at);
  rc = text ? command_fingerprint(cmd, want) : IDEM_ENOMEM;
  json_decref(cmd);
  if (rc != IDEM_OK) {
    free(text);
    return idemd_reply_store_error(r, rc);
  }
  row = (idemd_resource_t){.tenant_id = r->tenant.id,
                           .kind = "order",
                           .id = r->resource_id,
                           .status = "created",
                           .body = text,
                           .who = {r->request_id, "PUT /orders/{id}"}};
  rc = idemd_order_put(r->srv->store, &row, &existing);
  if (rc == IDEM_OK) {
    idemd_reply_headers_t h = {.location = location};
    snprintf(location, sizeof location, "/orders/%s", r->resource_id);
    r->outcome = OUTCOME_NEW;
    ret = idemd_reply(r, 201, text, strlen(text), &h);
  } else if (rc == IDEM_EEXIST) {
    rc = existing ? stored_fingerprint(existing, have) : IDEM_EINVAL;
    if (rc == IDEM_ENOMEM) {
      ret = idemd_reply_store_error(r, rc);
    } else if (rc == IDEM_OK && strcmp(have, want) == 0) {
      r->outcome = OUTCOME_REPLAY; /* the order there: not a replay of a key */
      ret = idemd_reply(r, 200, existing, strlen(existing), NULL);
    } else {
      r->outcome = OUTCOME_MISMATCH;
      ret = idemd_reply_error(r, 409, "order exists with different content", NULL);
    }
  } else {
    ret = idemd_reply_store_error(r, rc);
  }
  free(existing);
  free(text);
  return ret;
}

enum MHD_Result idemd_orders_cancel(idemd_request_t *r, const json_t *body) {
  static const char *const no_fields[] = {NULL};
  char *text = NULL;
  enum MHD_Result ret;
  idemd_actor_t who = {r->request_id, "POST /orders/{id}/cancel"};
  int changed = 0, rc;

  if (body && json_object_size(body) > 0) {
    json_t *errors = json_array();
    idemd__unknown_fields(body, no_fields, "", errors);
    r->outcome = OUTCOME_INVALID;
    return idemd_reply_errors(r, errors);
  }
  rc = idemd_order_id_valid(r->resource_id)
           ? idemd_order_cancel(r->srv->store, r->tenant.id, r->resource_id, &who, &text,
                                &changed)
           : IDEM_ENOTFOUND; /* no order has such an id */
  if (rc == IDEM_ENOTFOUND) {
    r->outcome = OUTCOME_INVALID;
    return idemd_reply_error(r, 404, "order not found", NULL);
  }
  if (rc != IDEM_OK)
    return idemd_reply_store_error(r, rc);
  r->outcome = changed ? OUTCOME_NEW : OUTCOME_REPLAY;
  ret = idemd_reply(r, 200, text, strlen(text), NULL);
  free(text);
  return ret;
}
