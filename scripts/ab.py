"""Interleaved A/B of decoding methods in one process: the check behind a small speed claim on a noisy machine.

    python scripts/ab.py --batch 4 vanilla chain:5@fp32 chain:5@bf16 dynamic:16/5/2@fp32 dynamic:16/5/2@bf16
    python scripts/ab.py --against 1f8ec11 vanilla chain:7 auto     # this tree's code against an earlier commit's
    python scripts/ab.py --batch 4 --serve 16 --static-too vanilla chain:5 auto   # continuous vs static batches
    python scripts/ab.py --temperature 0.8 vanilla auto chain:5 dynamic:8/2/4     # sampled (top-p 0.95)

A method is ``vanilla``, ``chain:D``, ``static`` (EAGLE's 26-node shape), ``dynamic:T/D/K`` (calibrated),
``best_first:T/D`` (DDTree's tree from a one-pass head: ``+NAME`` of a parallel or DFlash head; calibrated where
the head has a calibration.yaml),
``auto`` (``tree=auto``; on an older REV without it, that code's ``tree.total_tokens=auto`` as its bench ran it)
or ``lookup:D`` (prompt lookup beside a D-deep chain), with ``@fp32`` / ``@bf16`` / ``@auto`` for the draft head's
dtype (default auto), or ``@int8`` for the auto dtype's head with int8 weights (``draft.quantize=int8``), then
``+NAME`` for the draft head ``--head NAME=DIR`` instead of the bundled ``tiny-code-eagle`` (e.g.
``chain:7@int8+new --head new=outputs/train/x/export``; τ compares heads on any machine, busy or not), then
``{KEY=VALUE,...}`` for the policy's own config keys (``"auto{max_depth=8,top_k=1}"``: the keys of
``conf/tree/auto.yaml``), then ``!`` for a fresh policy on every call (``auto!``: cold, its step costs cached).
Bundled model, bf16 target, third-party prompts, ragged batches, finished rows leave the batch. Within a pass the
methods take turns on each batch, the order rotating; each pass's ratio is to that pass's
vanilla, so a machine that speeds up or slows down between passes moves every method alike (``bench.batch_sizes``
does the same for a whole report).

``--against REV`` also runs every method on the package as it was at git revision REV, in the same process
(a copy under another package name, in a temporary directory), each ratio to that code's own vanilla, and
prints new ÷ old per method: how a code change is measured here, where separate runs minutes apart differ by
±15 %.
"""
from __future__ import annotations

import argparse
import importlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]


def policy(kind: str, arg: str, P, head: str = "tiny-code-eagle", knobs: dict | None = None):
    """The tree policy of a method, from ``P`` (a ``treedec.tree.policies`` module: this tree's or an old one's);
    ``knobs``: config keys of the policy (``auto`` only)."""
    calibrated, knobs = dict(calibration="auto", draft_path=head), knobs or {}
    if knobs and kind != "auto":
        raise SystemExit(f"{kind}: only auto takes {{KEY=VALUE}} (the other methods' settings are in their names)")
    if kind == "chain":
        return P.ChainPolicy(int(arg))
    if kind == "static":
        return P.StaticPolicy(shape="eagle_mc_sim_7b_63")
    if kind == "dynamic":
        T, d, k = map(int, arg.split("/"))
        return P.DynamicPolicy(total_tokens=T, depth=d, top_k=k, **calibrated)
    if kind == "auto":
        if hasattr(P, "AutoPolicy"):
            return P.AutoPolicy(**calibrated, **knobs)
        return P.DynamicPolicy(total_tokens="auto", depth=7, top_k=4, min_depth=5, chain_depth=10, **calibrated)
    if kind == "best_first":
        T, d = map(int, arg.split("/"))
        try:  # calibrated by the head's calibration.yaml where it has one
            return P.BestFirstPolicy(total_tokens=T, depth=d, **calibrated)
        except TypeError:  # an older REV's, which reads raw marginals only
            return P.BestFirstPolicy(total_tokens=T, depth=d)
    if kind == "lookup":
        return P.LookupPolicy(P.ChainPolicy(int(arg)))
    raise SystemExit(f"unknown method {kind!r}: vanilla, chain:D, static, dynamic:T/D/K, best_first:T/D, auto or "
                     "lookup:D")


def policy_knobs(spec: str) -> tuple[str, dict]:
    """``METHOD{a=1,b=0.5}`` -> (``METHOD``, {a: 1, b: 0.5}): the policy's config keys (ints where written so)."""
    if not spec.endswith("}") or "{" not in spec:
        return spec, {}
    spec, _, body = spec[:-1].partition("{")
    number = lambda v: int(v) if v.strip().lstrip("-").isdigit() else float(v)
    try:
        return spec, {k.strip(): number(v) for k, v in (kv.split("=") for kv in body.split(",") if kv.strip())}
    except ValueError:
        raise SystemExit(f"{spec}{{{body}}}: write config keys as NAME=NUMBER, comma-separated") from None


def revision_package(rev: str) -> str:
    """Copy ``treedec/`` as of git revision ``rev`` into a temporary directory as package ``treedec_<rev>`` (its own
    imports renamed), put it on ``sys.path`` and return its name. Nothing in the working tree is touched."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    name = f"treedec_{sha}"
    tmp = Path(tempfile.mkdtemp(prefix="treedec-ab-"))
    top = subprocess.run(["git", "ls-tree", "--name-only", sha, "conf/__init__.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()  # conf/ at the top level ships as treedec.conf
    archive = subprocess.run(["git", "archive", sha, "treedec", *(["conf"] if top else [])], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    if top:
        (tmp / "conf").rename(tmp / "treedec" / "conf")
    (tmp / "treedec").rename(tmp / name)
    for f in (tmp / name).rglob("*.py"):
        f.write_text(re.sub(r"\btreedec(?=\.|\s+import\b)", name, f.read_text()))
    sys.path.insert(0, str(tmp))
    return name


def build_runs(pkg: str, methods: list[str], tokens: int, tag: str = "", slots: int | None = None,
               serve: bool = False, head_dirs: dict | None = None, temperature: float | None = None) -> dict:
    """``name + tag`` -> a function decoding a batch of prompts with that method, on package ``pkg``'s code.
    ``serve``: through ``Decoder.serve`` (vanilla's finished rows leave the batch too), the batch a queue for
    ``slots`` rows (None: all at once); else ``generate`` (what an older REV has). ``head_dirs``: NAME -> the
    head directory a method's ``+NAME`` loads. ``temperature``: sampled decoding (top-p 0.95), every call seeded alike."""
    mod = lambda m: importlib.import_module(f"{pkg}.{m}")
    models, vanilla = mod("models"), mod("decoding.vanilla")
    try:
        heads_mod = mod("heads")
    except ModuleNotFoundError:  # an older REV kept the head in models.draft
        heads_mod = mod("models.draft")
    load_head = getattr(heads_mod.DraftHead, "load", None) or heads_mod.load_head  # (an older REV: DraftHead.load)
    CompactingDecoder = getattr(mod("decoding.speculative"), "CompactingDecoder", None) or mod(
        "training.predict").CompactingDecoder  # (an older REV kept it there)
    target = models.load_model("tiny-code", dtype=torch.bfloat16)
    heads, runs = {}, {}
    sampling = None if temperature is None else mod("sampling").SamplingParams(temperature, top_p=0.95)

    def gen(decode, rows):  # sampled: a fresh generator each call, so every method draws from the same seed
        return decode(rows, tokens, **({} if sampling is None else {"generator": torch.Generator().manual_seed(0)}))

    for spec in methods:
        name_as_given = spec
        spec, fresh = spec.removesuffix("!"), spec.endswith("!")
        spec, knobs = policy_knobs(spec)
        spec_head, _, head_name = spec.partition("+")
        name, _, dtype = spec_head.partition("@")
        kind, _, arg = name.partition(":")
        head = (head_dirs or {}).get(head_name, "tiny-code-eagle") if head_name else "tiny-code-eagle"
        if head_name and head_name not in (head_dirs or {}):
            raise SystemExit(f"{spec}: no --head {head_name}=DIR given")
        if kind == "vanilla":
            plain = vanilla.VanillaDecoder(target, *([sampling] if sampling else []))
            runs[spec + tag] = (lambda rows: plain.serve(rows, tokens, slots, compact=True)) if serve else (
                (lambda rows: gen(plain.generate, rows)) if sampling else (lambda rows: vanilla.generate(target, rows, tokens)))
            continue
        dtype = dtype or "auto"
        if (dtype, head) not in heads:
            q = dtype == "int8"
            heads[dtype, head] = load_head(head, target=target, dtype="auto" if q else dtype,
                                           **({"quantize": "int8"} if q else {}))
        try:
            pol = policy(kind, arg, mod("tree.policies"), head, knobs)
        except TypeError as e:
            raise SystemExit(f"{name_as_given}: {e} (the keys of conf/tree/auto.yaml)") from None
        if fresh:  # a new policy (and decoder) for every call: what a process decoding one request sees
            make = lambda h=heads[dtype, head], k=kind, a=arg, n=head, kn=knobs: CompactingDecoder(
                target, h, policy(k, a, mod("tree.policies"), n, kn), *([sampling] if sampling else []))
        else:
            dec = CompactingDecoder(target, heads[dtype, head], pol, *([sampling] if sampling else []))
            make = lambda dec=dec: dec  # one decoder for every call
        runs[name_as_given + tag] = (lambda rows, make=make: make().serve(rows, tokens, slots)) if serve else (
            lambda rows, make=make: gen(make().generate, rows))
    return runs


def in_batches(fn, size: int):
    """A run over a queue of prompts as static batches of ``size``, one after another (results merged)."""
    def run(rows):
        parts = [fn(rows[i:i + size]) for i in range(0, len(rows), size)]
        stats = SimpleNamespace(row_steps=sum(p.stats.row_steps for p in parts))
        return SimpleNamespace(tokens=[t for p in parts for t in p.tokens], stats=stats)
    return run


def interleave(runs: dict, batches: list, passes: int) -> tuple[dict, dict]:
    """Each method on every batch, turns rotating -> (tokens/s per pass, [tokens, row-steps]) per method."""
    names = list(runs)
    for n in names:  # warm-up: kernels, plans, tree=auto's step costs
        runs[n](batches[0])
    rate = {n: [] for n in names}
    steps = {n: [0, 0] for n in names}
    for p in range(passes):
        secs, toks = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
        for i, rows in enumerate(batches):
            j = (p + i) % len(names)
            for n in names[j:] + names[:j]:
                t = time.perf_counter()
                res = runs[n](rows)
                secs[n] += time.perf_counter() - t
                k = sum(len(r) for r in res.tokens)
                toks[n] += k
                steps[n][0] += k
                steps[n][1] += res.stats.row_steps
        for n in names:
            rate[n].append(toks[n] / secs[n])
    return rate, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("methods", nargs="+")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", metavar="REV", help="also run every method on the code at this git revision")
    ap.add_argument("--serve", type=int, metavar="Q", help="continuous batching: queues of Q prompts, each served "
                    "through --batch slots (Decoder.serve; vanilla too); default: static batches of --batch")
    ap.add_argument("--static-too", action="store_true", help="with --serve: also every method in static batches "
                    "of --batch (tagged [static], ratios to vanilla [static]), interleaved with the served runs")
    ap.add_argument("--temperature", type=float, help="sampled decoding at this temperature (top-p 0.95; each "
                    "call seeded alike); default greedy")
    ap.add_argument("--head", action="append", default=[], metavar="NAME=DIR",
                    help="a draft head directory that methods suffixed +NAME load (repeatable)")
    a = ap.parse_args()
    head_dirs = dict(h.split("=", 1) for h in a.head)
    if "vanilla" not in a.methods:
        raise SystemExit("include vanilla: every ratio is to it")
    torch.set_num_threads(a.threads)
    tag = f" [{a.against}]" if a.against else ""
    if a.temperature is not None and (a.against or a.serve):
        raise SystemExit("--temperature runs this tree's generate: no --against or --serve")
    if a.static_too and (a.against or not a.serve):
        raise SystemExit("--static-too compares --serve runs with static batches of this tree's code: "
                         "pass --serve Q, and no --against")
    slots = a.batch if a.serve else None
    runs = build_runs("treedec", a.methods, a.tokens, slots=slots, serve=bool(a.serve), head_dirs=head_dirs,
                      temperature=a.temperature)
    if a.against:
        runs.update(build_runs(revision_package(a.against), a.methods, a.tokens, tag, slots, head_dirs=head_dirs))
    elif a.serve and a.static_too:
        tag = " [static]"
        # each batch all at once, compacted
        static = build_runs("treedec", a.methods, a.tokens, tag, serve=True, head_dirs=head_dirs)
        runs.update({n: in_batches(f, a.batch) for n, f in static.items()})
    from treedec.data.prompts import load_prompt_set
    from treedec.models.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny-code")
    prompts = [tok.encode(p.text) for p in load_prompt_set("third_party", a.prompts, 128, tok, seed=0)]
    size = a.serve or a.batch
    rate, steps = interleave(runs, [prompts[i:i + size] for i in range(0, len(prompts), size)], a.passes)
    how = f"queues of {a.serve} through {a.batch} slots" if a.serve else f"static batches of {a.batch}"
    how += "" if a.temperature is None else f", sampled at {a.temperature} (top-p 0.95)"
    print(f"{how}, {len(prompts)} prompts x {a.tokens} tokens, {a.passes} passes, {a.threads} threads")
    for n in runs:
        ratios = [r / v for r, v in zip(rate[n], rate["vanilla" + (tag if tag and n.endswith(tag) else "")])]
        print(f"{n:24s} {statistics.median(rate[n]):8.1f} tok/s  x{statistics.median(ratios):.3f}  "
              f"tau {steps[n][0] / max(steps[n][1], 1):.2f}  per pass {' '.join(f'{r:.2f}' for r in ratios)}")
    if tag:
        for m in a.methods:
            r = [x / y for x, y in zip(rate[m], rate[m + tag])]
            print(f"{'served / static' if a.static_too else f'this tree / {a.against}'}  {m:16s} "
                  f"{statistics.median(r):.3f}  per pass "
                  f"{' '.join(f'{x:.3f}' for x in r)}")


if __name__ == "__main__":
    main()
