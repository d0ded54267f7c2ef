<?php
// A small PHP orders application written the naive way: it looks a key
// up, then inserts, so two requests with one key that arrive together
// both insert. It has no idempotency of its own; `idemd gateway` in front
// of it gives it docs/idempotency.md, section 2 (docs/gateway.md, "Quick
// start"; tests/gateway drives it). Served by
// `php -S 127.0.0.1:PORT orders.php`. ORDERS_DB names its SQLite file
// (default ./orders.db), ORDERS_WORK_MS how long it works between the
// look-up and the insert (default 200); for the tests, while the file
// ORDERS_DIE_MARKER names exists, it deletes it and is killed (SIGKILL)
// after its next INSERT, before answering.
$db = new SQLite3(getenv('ORDERS_DB') ?: 'orders.db');
$db->busyTimeout(10000);
$db->exec('PRAGMA journal_mode = WAL');
$db->exec('CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, idem_key TEXT, '
    . 'item TEXT NOT NULL, quantity INTEGER NOT NULL)');

$method = $_SERVER['REQUEST_METHOD'];
$path = parse_url($_SERVER['REQUEST_URI'], PHP_URL_PATH);

function answer(int $status, $doc, array $headers = []): void {
    http_response_code($status);
    header('Content-Type: application/json');
    foreach ($headers as $h) {
        header($h);
    }
    echo json_encode($doc), "\n";
}

if ($method === 'POST' && $path === '/orders') {
    $in = json_decode(file_get_contents('php://input'), true);
    if (!is_array($in) || !is_string($in['item'] ?? null) || !is_int($in['quantity'] ?? null)) {
        answer(422, ['error' => 'item (a string) and quantity (an integer) are required']);
        return;
    }
    $key = $_SERVER['HTTP_IDEMPOTENCY_KEY'] ?? null;
    // The naive check: SELECT, then INSERT.
    $st = $db->prepare('SELECT id FROM orders WHERE idem_key = :k');
    $st->bindValue(':k', $key);
    $row = $key === null ? false : $st->execute()->fetchArray(SQLITE3_ASSOC);
    if ($row) {
        answer(200, ['id' => $row['id'], 'item' => $in['item'], 'quantity' => $in['quantity']]);
        return;
    }
    usleep(1000 * (int)(getenv('ORDERS_WORK_MS') ?: 200));
    $st = $db->prepare('INSERT INTO orders (idem_key, item, quantity) VALUES (:k, :i, :q)');
    $st->bindValue(':k', $key);
    $st->bindValue(':i', $in['item']);
    $st->bindValue(':q', $in['quantity'], SQLITE3_INTEGER);
    $st->execute();
    $id = $db->lastInsertRowID();
    // For the tests: killed after its INSERT, before its answer, once.
    $marker = getenv('ORDERS_DIE_MARKER');
    if ($marker && @unlink($marker)) {
        posix_kill(getmypid(), 9);
    }
    answer(201, ['id' => $id, 'item' => $in['item'], 'quantity' => $in['quantity']],
           ["Location: /orders/$id", 'Set-Cookie: session=abc; HttpOnly']);
    return;
}
if ($method === 'GET' && preg_match('#^/orders/([0-9]+)$#', $path, $m)) {
    $st = $db->prepare('SELECT id, item, quantity FROM orders WHERE id = :id');
    $st->bindValue(':id', (int)$m[1], SQLITE3_INTEGER);
    $row = $st->execute()->fetchArray(SQLITE3_ASSOC);
    $row ? answer(200, $row) : answer(404, ['error' => 'no such order']);
    return;
}
if ($method === 'GET' && $path === '/count') {
    answer(200, ['orders' => $db->querySingle('SELECT count(*) FROM orders')]);
    return;
}
answer(404, ['error' => 'not found']);
