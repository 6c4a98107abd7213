#!/usr/bin/env python3
"""What the work of one request costs each component alone (docs/performance.md, "The floors").
Measurement only: nothing here is part of txflow.

  floors.py pg DATABASE_URL            the state machine's writes alone, 2,000 requests
  floors.py cross-signer DATABASE_URL  a move per signer against one move for 50 signers (pgbench)
  floors.py node ANVIL_BIN             the node's CPU per JSON-RPC call a request needs

The database must be migrated (`txflow migrate`) and hold nothing else: the scripts truncate
`managed_tx`, `tx_events`, `tx_outbox` and `signer_lease`. CPU is read from /proc: every
`postgres` process (the cluster's own background work counts too), or the node's process; run
them on an otherwise idle machine.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid):
    """utime + stime (+ reaped children's) of `pid`, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / TICK


def postgres_cpu():
    pids = subprocess.run(["pgrep", "-x", "postgres"], capture_output=True, text=True).stdout.split()
    total = 0.0
    for pid in pids:
        try:
            total += proc_cpu(pid)
        except OSError:
            pass
    return total


def psql(url, sql):
    env = dict(os.environ, PGOPTIONS="-c client_min_messages=warning")
    subprocess.run(["psql", "-q", "-v", "ON_ERROR_STOP=1", url], input=sql, text=True,
                   check=True, stdout=subprocess.DEVNULL, env=env)


EVENT = json.dumps({"event_id": "0" * 36, "request_id": "r" * 20, "chain_id": 31337,
                    "signer": "0x" + "a" * 40, "to": "0x" + "b" * 40, "value": "1",
                    "data": "0x" + "cd" * 36, "metadata": {}, "nonce": 1})


def pg_floor(url, signers=50, per_signer=40):
    """Per request one row created RECEIVED and six moves to CONFIRMED, each with its `tx_events`
    and `tx_outbox` row, the outbox rows deleted after each step (the mark after a produce); 40
    rows per statement, each statement its own committed transaction; no fence, no read, one
    confirmation list (the final one). Less than the pipeline must do for the same requests."""
    blocks = json.dumps([{"number": i, "hash": "0x" + "f" * 64, "parent_hash": "0x" + "f" * 64}
                         for i in range(12)])
    moves = [("SIMULATED", "TxSimulated", ""),
             ("ALLOCATED", "TxAllocated", ", nonce = v.n"),
             ("SIGNED", "TxSigned", ""),
             ("SUBMITTED", "TxSubmitted", ", next_receipt_check_at = now()"),
             ("MINED", "TxMined", ", receipt = '{\"status\":1}'::jsonb, mined_block_number = 1, "
              "mined_block_hash = '0x" + "e" * 64 + "', next_receipt_check_at = NULL"),
             ("CONFIRMED", "TxConfirmed", f", confirmed_at = now(), confirmations = '{blocks}'::jsonb")]
    out = []
    for s in range(signers):
        signer = "0x%040x" % s
        ids = "ARRAY[" + ",".join(f"'{uuid.uuid4()}'" for _ in range(per_signer)) + "]::uuid[]"
        out.append(f"""WITH c AS (INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, payload, state)
  SELECT id, 31337, '{signer}', 'req-' || id, '{EVENT}'::jsonb, 'RECEIVED' FROM unnest({ids}) id RETURNING tx_id),
e AS (INSERT INTO tx_events (event_id, tx_id, type, payload)
  SELECT gen_random_uuid(), tx_id, 'TxAccepted', '{EVENT}'::jsonb FROM c RETURNING event_id, tx_id)
INSERT INTO tx_outbox (event_id, tx_id, chain_id, signer, type)
  SELECT event_id, tx_id, 31337, '{signer}', 'TxAccepted' FROM e;""")
        out.append(f"DELETE FROM tx_outbox WHERE chain_id = 31337 AND signer = '{signer}';")
        for state, event, extra in moves:
            out.append(f"""WITH v AS (SELECT id, n FROM unnest({ids}) WITH ORDINALITY AS v(id, n)),
l AS (UPDATE managed_tx m SET state = '{state}'{extra}, updated_at = now() FROM v WHERE m.tx_id = v.id RETURNING m.tx_id),
e AS (INSERT INTO tx_events (event_id, tx_id, type, payload)
  SELECT gen_random_uuid(), tx_id, '{event}', '{EVENT}'::jsonb FROM l RETURNING event_id, tx_id)
INSERT INTO tx_outbox (event_id, tx_id, chain_id, signer, type)
  SELECT event_id, tx_id, 31337, '{signer}', '{event}' FROM e;""")
            out.append(f"DELETE FROM tx_outbox WHERE chain_id = 31337 AND signer = '{signer}';")
    psql(url, "TRUNCATE managed_tx, tx_events, tx_outbox CASCADE;")
    start, t0 = postgres_cpu(), time.monotonic()
    psql(url, "\n".join(out))
    cpu, wall = postgres_cpu() - start, time.monotonic() - t0
    n = signers * per_signer
    print(json.dumps({"measure": "pg_floor", "requests": n, "postgres_cpu_s": round(cpu, 3),
                      "ms_per_request": round(1000 * cpu / n, 3), "wall_s": round(wall, 3)}))


def cross_signer(url, signers=50, rows=40, drives=2000):
    """Two rows of a signer moved SIGNED <-> SUBMITTED with their audit and outbox rows, fenced:
    `per_signer` as the stages do now (BEGIN; settings and lease check; the move; the lease check
    FOR SHARE; COMMIT), `all_signers` the same statements for every signer at once, each row
    fenced by its own lease in the one move. pgbench with prepared statements, one client."""
    arr = "ARRAY[" + ",".join(f"'s{i}'" for i in range(signers)) + "]::text[]"
    flip = "state = CASE m.state WHEN 'SIGNED' THEN 'SUBMITTED' ELSE 'SIGNED' END, updated_at = now()"
    one = ("fence.role = 'broadcaster' AND fence.chain_id = 31337 AND fence.signer = 's' || :i "
           "AND fence.owner_node = 'node-a' AND fence.fencing_token = 1 "
           "AND fence.expires_at > clock_timestamp()")
    many = one.replace("fence.signer = 's' || :i", f"fence.signer = ANY({arr})")
    audit = ("events AS (INSERT INTO tx_events (event_id, tx_id, type, payload) SELECT event_id, tx_id, "
             f"'TxSubmitted', '{EVENT}'::jsonb FROM landed), outbox AS (INSERT INTO tx_outbox "
             "(event_id, tx_id, chain_id, signer, type) SELECT event_id, tx_id, 31337, signer, "
             "'TxSubmitted' FROM landed) SELECT count(*) FROM landed;")
    per_signer = f"""\\set i random(0, {signers - 1})
\\set j random(0, {rows // 2 - 1})
BEGIN;
SELECT set_config('idle_in_transaction_session_timeout', '20000', true), EXISTS (SELECT 1 FROM signer_lease fence WHERE {one}) AS current;
WITH fence_ok AS (SELECT 1 AS ok WHERE EXISTS (SELECT 1 FROM signer_lease fence WHERE {one})), u AS (SELECT md5('s' || :i || '-' || j)::uuid AS tx_id, gen_random_uuid() AS event_id FROM generate_series(2 * :j, 2 * :j + 1) j), landed AS (UPDATE managed_tx m SET {flip}, fencing_token = 1 FROM u WHERE m.tx_id = u.tx_id AND m.chain_id + 0 = 31337 AND m.signer || '' = 's' || :i AND m.state = ANY('{{SIGNED,SUBMITTED}}'::text[]) AND EXISTS (SELECT 1 FROM fence_ok) RETURNING m.tx_id, m.signer, u.event_id), {audit}
SELECT 1 FROM signer_lease fence WHERE {one} FOR SHARE;
COMMIT;
"""
    all_signers = f"""\\set j random(0, {rows // 2 - 1})
BEGIN;
SELECT set_config('idle_in_transaction_session_timeout', '20000', true), (SELECT count(*) FROM signer_lease fence WHERE {many}) AS current;
WITH u AS (SELECT md5(s || '-' || j)::uuid AS tx_id, s AS signer, 1::bigint AS token, gen_random_uuid() AS event_id FROM unnest({arr}) s, generate_series(2 * :j, 2 * :j + 1) j), landed AS (UPDATE managed_tx m SET {flip}, fencing_token = u.token FROM u WHERE m.tx_id = u.tx_id AND m.chain_id + 0 = 31337 AND m.signer || '' = u.signer AND m.state = ANY('{{SIGNED,SUBMITTED}}'::text[]) AND EXISTS (SELECT 1 FROM signer_lease fence WHERE fence.role = 'broadcaster' AND fence.chain_id = 31337 AND fence.signer = u.signer AND fence.owner_node = 'node-a' AND fence.fencing_token = u.token AND fence.expires_at > clock_timestamp()) RETURNING m.tx_id, m.signer, u.event_id), {audit}
SELECT count(*) FROM (SELECT 1 FROM signer_lease fence WHERE {many} FOR SHARE) f;
COMMIT;
"""
    psql(url, f"""TRUNCATE managed_tx, tx_events, tx_outbox, signer_lease CASCADE;
INSERT INTO signer_lease (role, chain_id, signer, owner_node, fencing_token, expires_at, updated_at)
  SELECT 'broadcaster', 31337, 's' || i, 'node-a', 1, now() + interval '1 day', now()
  FROM generate_series(0, {signers - 1}) i;
INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, payload, state, nonce)
  SELECT md5('s' || i || '-' || j)::uuid, 31337, 's' || i, 'r-' || i || '-' || j,
         '{{"to":"0xbb","value":"1"}}'::jsonb, 'SIGNED', j
  FROM generate_series(0, {signers - 1}) i, generate_series(0, {rows - 1}) j;""")
    with tempfile.TemporaryDirectory() as d:
        for name, script, runs in (("per_signer", per_signer, drives),
                                    ("all_signers", all_signers, drives // signers)):
            path = os.path.join(d, name + ".sql")
            with open(path, "w") as f:
                f.write(script)
            psql(url, "VACUUM ANALYZE managed_tx;")
            start = postgres_cpu()
            subprocess.run(["pgbench", "-n", "-M", "prepared", "-c", "1", "-t", str(runs),
                            "-f", path, url], check=True, capture_output=True)
            cpu = postgres_cpu() - start
            moved = 2 * (runs if name == "per_signer" else runs * signers)
            print(json.dumps({"measure": "cross_signer", "shape": name, "transactions": runs,
                              "rows": moved, "postgres_cpu_s": round(cpu, 3),
                              "ms_per_row": round(1000 * cpu / moved, 3)}))


def node(anvil_bin, calls=2000, batch=20):
    """The node's CPU per call, for the calls one request needs: a simulation, a send (signed by
    the node here; the bench's chain-alone phase measures raw sends), a receipt, a nonce read.
    JSON-RPC batches of `batch` calls, so that HTTP costs little."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([anvil_bin, "--host", "127.0.0.1", "--port", str(port), "--block-time",
                          "0.2", "--max-persisted-states", "0"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def rpc(batch_calls):
        body = json.dumps([{"jsonrpc": "2.0", "id": i, "method": m, "params": a}
                           for i, (m, a) in enumerate(batch_calls)]).encode()
        req = urllib.request.Request(url, body, {"content-type": "application/json"})
        with urllib.request.urlopen(req) as r:
            return json.loads(r.read())

    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                rpc([("eth_chainId", [])])
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        account = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266"  # anvil's first dev account
        to, data = "0x000000000000000000000000000000000000dEaD", "0x" + "74786666" * 8

        def phase(method, params):
            start = proc_cpu(p.pid)
            answers = []
            for i in range(0, calls, batch):
                answers += rpc([(method, params(k)) for k in range(i, min(i + batch, calls))])
            time.sleep(0.5)  # the blocks that mine what was sent
            cpu = proc_cpu(p.pid) - start
            print(json.dumps({"measure": "node", "method": method, "calls": calls,
                              "node_cpu_s": round(cpu, 3),
                              "ms_per_call": round(1000 * cpu / calls, 4)}))
            return answers

        phase("eth_estimateGas", lambda k: [{"from": account, "to": to, "value": "0x1", "data": data}])
        sent = phase("eth_sendTransaction", lambda k: [{
            "from": account, "to": to, "value": "0x1", "data": data, "nonce": hex(k),
            "gas": "0x10000", "maxFeePerGas": hex(10 ** 10), "maxPriorityFeePerGas": hex(10 ** 9)}])
        hashes = [a.get("result") for a in sent]
        time.sleep(1)
        phase("eth_getTransactionReceipt", lambda k: [hashes[k]])
        phase("eth_getTransactionCount", lambda k: [account, "latest"])
    finally:
        p.terminate()
        p.wait()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("pg", "cross-signer", "node"):
        sys.exit(__doc__)
    {"pg": pg_floor, "cross-signer": cross_signer, "node": node}[sys.argv[1]](sys.argv[2])
