/* Request bodies of idemd, as one include: the body's pre-scan and parse
 * (body.h), the payment command (payment_cmd.h), the order command
 * (order_cmd.h) and the refund command (refund_cmd.h). */
#ifndef IDEMD_VALIDATE_H
#define IDEMD_VALIDATE_H

#include "server/body.h"
#include "server/fields.h"
#include "server/order_cmd.h"
#include "server/payment_cmd.h"
#include "server/refund_cmd.h"

#endif
