"""The soak through the cluster's ingress: many users for minutes, a third of the replies cut
by their reader, one replica killed halfway (``lmserve_core.testing.soak``).

    python benchmarks/soak_cluster.py [--model smollm2] [--minutes 5] [--clients 16]
        [--out DIR] [--json OUT]

Needs ``ray[serve]``. ``lmserve cluster --replicas 2 --replica-cpus 1 --kv-slots 16``; the
replica killed is the first by name. Prints how the requests ended (done, cut by the
client, lost, hung), the refusals retried, the killed replica's conversations and the
cached share of their later turns, the descriptors and memory of the ingress and of the
other replica at a quarter of the run and at its end, and what :func:`soak.check` finds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import model_path  # noqa: E402
from bench_serve import free_port, serving  # noqa: E402
from results import Report, add_output_options, cpu_model  # noqa: E402

from lmserve_core.testing import soak  # noqa: E402

KV_SLOTS = 16
CTX = 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=16)
    add_output_options(parser)
    args = parser.parse_args()
    report = Report("soak", args, 2)
    report.print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; {args.model}, {args.clients} "
                 f"clients for {args.minutes} minutes, 2 replicas x 1 thread")
    port = free_port()
    cmd = [sys.executable, "-m", "lmserve_core", "cluster", str(model_path(args.model)),
           "--port", str(port), "--replicas", "2", "--replica-cpus", "1",
           "--kv-slots", str(KV_SLOTS), "--ctx", str(CTX), "--log-level", "warning"]
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "cluster.log"
    with serving(cmd, port, log) as url:
        found = soak.cluster_replicas(url)
        if len(found) != 2:
            raise SystemExit(f"found replicas {found}")
        victim, survivor = sorted(found)

        def kill() -> str:
            os.kill(found[victim], signal.SIGKILL)
            return victim

        def watch() -> dict[str, int]:
            pid = soak.cluster_ingress_pid()
            return {"replica": found[survivor], **({"ingress": pid} if pid else {})}

        run = asyncio.run(soak.soak(url, seconds=args.minutes * 60, clients=args.clients,
                                    fault=kill, watch=watch))
    figures = soak.summary(run)
    # a replica's KV slots commit their pages as conversations fill them (SmolLM2: 23 KiB a
    # position)
    problems = soak.check(run, mib_slack={"replica": KV_SLOTS * CTX * 23 / 1024})
    for key, value in figures.items():
        report.print(f"{key}: {value}")
    report.print("problems: " + ("; ".join(problems) if problems else "none"))
    report.finish(figures=figures, problems=problems)


if __name__ == "__main__":
    main()
