/* POST /orders and GET /orders/{id}. An order has no outside effect, so it
 * is written together with its idempotency record, already completed, in
 * the one transaction that reserves the key. */
#include <stdlib.h>
#include <string.h>

#include "idem/canon.h"
#include "idem/clock.h"
#include "idem/crypto.h"
#include "data/resources.h"
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
  oc->row = (idemd_resource_t){.tenant_id = oc->row.tenant_id, .kind = "order",
                               .id = oc->id, .status = "created", .body = oc->text};
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
  /* Owned by the request from here (a worker's second run replaces the
   * event thread's first): the flow may go on after this call returns. */
  if (r->call_free)
    r->call_free(r->call);
  r->call = oc;
  r->call_free = order_call_free;
  oc->cmd = cmd;
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
