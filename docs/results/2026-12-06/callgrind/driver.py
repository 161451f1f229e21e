# ruff: noqa: E402, E501, SIM115, ASYNC220  (a measurement script kept as it was run)
"""Callgrind driver: instructions per request of the gateway's and the bare proxy's serving
processes. Usage: python driver.py TREE N [arms]"""

import asyncio
import glob
import os
import random
import re
import signal
import subprocess
import sys
import time

tree = sys.argv[1]
N = int(sys.argv[2])
arms = sys.argv[3].split(",") if len(sys.argv) > 3 else ["gateway", "bare"]
sys.path.insert(0, tree)
os.chdir(tree)
from cachecore.testing import free_ports, wait_for_port
from loadtest.bench_gateway import (
    ADMIN_KEY,
    SALT_SECRET,
    VOCAB,
    HttpConn,
    _env,
    _wait_health,
    completion_request,
)

py = "/work/main/.venv/bin/python"
out = f"/tmp/cg/out-{os.path.basename(tree.rstrip('/'))}" + (
    "-prof" if os.environ.get("PROF") == "1" else ""
)
os.makedirs(out, exist_ok=True)
for f in glob.glob(out + "/*"):
    os.remove(f)
rport, gport, bport = free_ports(3)
PROF = os.environ.get("PROF") == "1"
vg = [] if PROF else ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-instr=no"]
SITE = "/tmp/cg/psite" if PROF else "/tmp/cg/site"
env = _env({"PYTHONPATH": tree + ":" + SITE})
procs = {}
procs["replica"] = subprocess.Popen(
    [
        py,
        "-m",
        "gateway.cli",
        "replica",
        "--count",
        "1",
        "--http-ports",
        str(rport),
        "--no-events",
        "--time-scale",
        "0.01",
        "--log-level",
        "WARNING",
    ],
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
)
_wait_health(f"http://127.0.0.1:{rport}/health", procs["replica"])
if "gateway" in arms:
    procs["gateway"] = subprocess.Popen(
        [
            *vg,
            *([] if PROF else [f"--callgrind-out-file={out}/gateway.%p"]),
            py,
            "-m",
            "gateway.cli",
            "serve",
            "--open",
            "--replica",
            f"sim0=http://127.0.0.1:{rport}",
            "--port",
            str(gport),
            "--seed",
            "1",
            "--policy",
            "/tmp/cg/policy.yaml",
            "--log-level",
            "WARNING",
        ],
        env=_env(
            {
                "PYTHONPATH": tree + ":" + SITE,
                "KVGATE_ADMIN_KEY": ADMIN_KEY,
                "KVGATE_SALT_SECRETS": SALT_SECRET,
            }
        ),
        stdout=open(out + "/gw.log", "wb"),
        stderr=subprocess.STDOUT,
    )
if "bare" in arms:
    procs["bare"] = subprocess.Popen(
        [
            *vg,
            *([] if PROF else [f"--callgrind-out-file={out}/bare.%p"]),
            py,
            "-m",
            "loadtest.bench_gateway",
            "bare-proxy",
            str(bport),
            f"http://127.0.0.1:{rport}",
        ],
        env=env,
        stdout=open(out + "/bare.log", "wb"),
        stderr=subprocess.STDOUT,
    )
ports = {"gateway": gport, "bare": bport}


def ctl(*a):
    return subprocess.run(["callgrind_control", *a], capture_output=True, text=True).stdout


try:
    if "gateway" in arms:
        _wait_health(f"http://127.0.0.1:{gport}/health", procs["gateway"], 300)
    if "bare" in arms:
        wait_for_port(bport, 300.0)
    rng = random.Random(1)

    async def main():
        conns = {a: HttpConn("127.0.0.1", ports[a]) for a in arms}
        for c in conns.values():
            await c.connect()

        async def send(a, n):
            for _ in range(n):
                p = [rng.randrange(1, VOCAB) for _ in range(2048)]
                try:
                    st, body, _ = await conns[a].request(
                        completion_request("127.0.0.1", ports[a], p), 120
                    )
                except ConnectionError:
                    print("reconnect", a)
                    conns[a].writer = None
                    continue
                assert st == 200, body

        for a in arms:
            for _ in range(120):
                p = [rng.randrange(1, VOCAB) for _ in range(2048)]
                st, _body, _ = await conns[a].request(
                    completion_request("127.0.0.1", ports[a], p), 120
                )
                if st == 200:
                    break
                await asyncio.sleep(1.0)
            await send(a, 60)
        res = {}
        for a in arms:
            pid = procs[a].pid
            # idle window for the background rate
            os.kill(pid, signal.SIGUSR1)
            t0 = time.monotonic()
            await asyncio.sleep(5.0)
            os.kill(pid, signal.SIGUSR2)
            idle_t = time.monotonic() - t0
            await asyncio.sleep(1.0)
            os.kill(pid, signal.SIGUSR1)
            t0 = time.monotonic()
            if os.environ.get("PYSPY"):
                sp = subprocess.Popen(
                    [
                        "/tmp/tools/bin/py-spy",
                        "record",
                        "-r",
                        "1000",
                        "-f",
                        "raw",
                        "-o",
                        f"/tmp/cg/spy-{a}.txt",
                        "-p",
                        str(pid),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                await asyncio.sleep(2.0)
            await send(a, N)
            if os.environ.get("PYSPY"):
                sp.send_signal(signal.SIGINT)
                sp.wait(30)
            os.kill(pid, signal.SIGUSR2)
            busy_t = time.monotonic() - t0
            await asyncio.sleep(1.0)
            res[a] = (idle_t, busy_t)
        return res

    res = asyncio.run(main())
    if PROF:
        sys.exit(0)
    time.sleep(1.0)
    for a, (it, bt) in res.items():
        files = sorted(glob.glob(f"{out}/{a}.*"))
        tot = {}
        for f in files:
            txt = open(f).read()
            m = re.search(r"^desc: Trigger: Client Request: (\w+)", txt, re.M)
            s = re.search(r"^totals: (\d+)", txt, re.M)
            if m and s:
                tot[m.group(1)] = (int(s.group(1)), f)
        idle_ir = tot["idle"][0] / it
        busy = tot["busy"][0]
        net = busy - idle_ir * bt
        print(
            f"{a}: busy {busy / N:,.0f} Ir/req, idle {idle_ir:,.0f} Ir/s x {bt:.1f}s -> net {net / N:,.0f} Ir/req  file {tot['busy'][1]}"
        )
finally:
    for p in procs.values():
        p.terminate()
    for p in procs.values():
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
