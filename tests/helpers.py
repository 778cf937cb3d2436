"""The suite's shared helpers: the one factory of tiny models (random Llama-family targets, draft heads bound to them,
a plain greedy reference and an oracle policy; session fixtures over them: ``tests/conftest.py``) and the one way to
compose an entry point's config (:func:`compose_config`)."""
from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest
import torch

from treedec.heads import DraftConfig, build_head
from treedec.models import LlamaConfig, Transformer
from treedec.tree import Tree
from treedec.tree.policies.base import TreePolicy

# The pretraining tests' model: small enough to train a few steps in seconds on a CPU.
TINY_ARCH = dict(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=0,
                 eos_token_id=0)

# Triton ships with torch on Linux only (CPU runs use its interpreter): its tests skip only where it is not installed.
HAVE_TRITON = importlib.util.find_spec("triton") is not None
NO_TRITON = "Triton is not installed (torch ships it on Linux only)"
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)


def compose_config(name: str, overrides=(), *, hydra: bool = False, config_dir=None, job_name: str = "app"):
    """The config ``python -m treedec.<name> OVERRIDES`` composes from conf/, with the schemas its command registers
    (or a config of ``config_dir`` as it is); with ``hydra``, its hydra node too (the choices name each group, as in
    a real run)."""
    from hydra import compose, initialize_config_dir

    from treedec.models.paths import CONF

    if config_dir is None:
        entry_module(name)  # the command's imports register its schemas, as in a real run
    with initialize_config_dir(config_dir=str(config_dir or CONF), version_base="1.3", job_name=job_name):
        return compose(config_name=name, overrides=list(overrides), return_hydra_config=hydra)


def entry_module(name: str):
    """The module of ``python -m treedec.<name>`` (bench's is its ``__main__``)."""
    import importlib

    return importlib.import_module("treedec.bench.__main__" if name == "bench" else f"treedec.{name}")


def local_config(text: str):
    """A setup writing ``text`` as ``{tmp}/conf/local/default.yaml`` (passed as ``--config-dir={tmp}/conf``)."""
    def setup(monkeypatch, tmp_path):
        (tmp_path / "conf" / "local").mkdir(parents=True)
        (tmp_path / "conf" / "local" / "default.yaml").write_text(text)
    return setup


def tiny_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    base.update(kw)
    return LlamaConfig(**base)


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.08) -> torch.nn.Module:
    """Weights large enough that logits are well separated; norms and biases non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model


def tiny_model(seed: int = 0, backend: str = "sdpa", fuse: bool = True, **kw) -> Transformer:
    """Random weights (drawn unfused, so a seed gives the same model either way), fused like ``load_model``'s."""
    torch.manual_seed(seed)
    model = randomize_(Transformer(tiny_config(**kw), attn_backend=backend), seed).eval()
    return model.fuse() if fuse else model


def make_pair(seed: int = 0, vocab: int = 64, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
              backend: str = "sdpa", ctx: int = 1024, peaked: float = 1.0):
    """A target (default init, its LM head scaled by ``peaked``) and a random (untrained) draft head bound to it."""
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=ctx,
                      rms_norm_eps=LlamaConfig.rms_norm_eps)
    target = Transformer(cfg, backend).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(peaked)
    draft = build_head(DraftConfig.for_target(cfg)).eval().bind(target)
    return target, draft


def eagle3_pair(seed: int, vocab: int = 64, k: int = 40, **kw):
    """A random target of 4 layers and a random EAGLE-3 head over ``k`` random draft tokens (0: all)."""
    target, _ = make_pair(seed, vocab=vocab, layers=4, **kw)
    head = build_head(DraftConfig.for_target(target.config, kind="eagle3", draft_vocab_size=k))
    if k:
        head.restrict_vocab(torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:k])
    return target, head.eval().bind(target)


def parallel_pair(seed: int = 0, K: int = 5, k: int = 40, sharpen: float = 1.0, **kw):
    """A random target and a one-pass (P-EAGLE) head of ``block_size`` K converted from :func:`eagle3_pair`'s EAGLE-3
    head, its mask inputs random (so each depth's marginal differs from the others). ``sharpen`` scales the head's
    final norm, so its logits: a random head's marginals are near uniform, and a best-first tree of them is all depth 1
    (the 15th best token still outscores the best pair of tokens); sharpen=4 gives trees 2 to 4 deep."""
    from treedec.heads.parallel import ParallelHead

    target, e3 = eagle3_pair(seed, k=k, **kw)
    head = ParallelHead.from_eagle3(e3, K)
    with torch.no_grad():
        head.mask_embed.normal_(0, 1, generator=torch.Generator().manual_seed(seed))
        head.mask_hidden.normal_(0, 1, generator=torch.Generator().manual_seed(seed + 1))
        head.norm.weight.mul_(sharpen)
    return target, head.eval().bind(target)


def dflash_pair(seed: int = 0, K: int = 5, k: int = 40, sharpen: float = 1.0, layers: int = 2, attn: float = 1.0,
                **kw):
    """A random target of 4 layers and a random DFlash head drafting K depths with ``layers`` layers over ``k`` random
    draft tokens (0: all), its mask input random; ``sharpen`` scales its final norm (as :func:`parallel_pair`), ``attn``
    its q/k projections: every mask position reads the same input, so only sharp attention (RoPE) sets the depths'
    marginals apart in a random head."""
    target, _ = make_pair(seed, layers=4, **kw)
    head = build_head(DraftConfig.for_target(target.config, kind="dflash", block_size=K, draft_layers=layers,
                                             draft_vocab_size=k))
    g = torch.Generator().manual_seed(seed)
    if k:
        head.restrict_vocab(torch.randperm(target.config.vocab_size, generator=g)[:k])
    with torch.no_grad():
        head.mask_embed.normal_(0, 1, generator=g)
        head.norm.weight.mul_(sharpen)
        for layer in head.layers:
            layer.self_attn.q_proj.weight.mul_(attn)
            layer.self_attn.k_proj.weight.mul_(attn)
    return target, head.eval().bind(target)


@torch.inference_mode()
def host_reads_per_step(dec, seed: int = 0, warm: int = 8, n: int = 50) -> tuple[float, int, object, dict]:
    """Host reads per decoding step of ``dec`` over a two-row batch, after a warm-up call (plans, constants and step
    costs built): (reads per step, the steps they were counted over, the timed call's result, the reads by kind)."""
    from treedec.profiling import count_ops

    g = torch.Generator().manual_seed(seed)
    prompts = [[1, 2, 3], [4, 5]]
    dec.generate(prompts, warm, generator=g)
    marks = []
    with count_ops() as c:
        res = dec.generate(prompts, n, generator=g, hook=lambda _: marks.append(c.host_reads))
    return (marks[-1] - marks[0]) / (len(marks) - 1), len(marks) - 1, res, c.reads


def full_logits(model: Transformer, ids, position_offset: int = 0) -> torch.Tensor:
    """Logits [B, T, V] of one plain forward over ``ids`` from an empty cache."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    pos = None
    if position_offset:
        pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1) + position_offset
    return model(ids, cache, position_ids=pos).logits


@torch.inference_mode()
def greedy_reference(target: Transformer, prompt: list[int], n: int) -> list[int]:
    """Plain left-to-right greedy decoding, one token per forward."""
    cache = target.new_cache(1, len(prompt) + n + 1)
    logits = target(torch.tensor([prompt]), cache, logits="last").logits
    cache.advance(len(prompt))
    out = []
    for _ in range(n):
        t = int(logits[0, -1].argmax())
        out.append(t)
        logits = target(torch.tensor([[t]]), cache).logits
        cache.advance(1)
    return out


class OraclePolicy(TreePolicy):
    """Wraps a policy and, with probability ``p_hit``, rewrites a node on the target's own greedy path
    to the correct token, so that long paths get accepted. Verification must stay lossless for any
    draft tokens, so this exercises deep accepts, commits and catch-ups that a random draft never reaches."""

    def __init__(self, inner: TreePolicy, references: list[list[int]], p_hit: float = 0.8, seed: int = 0):
        self.inner, self.refs, self.p_hit = inner, references, p_hit
        self.max_depth, self.max_size, self.max_inputs = inner.max_depth, inner.max_size, inner.max_inputs
        self.max_rank = inner.max_rank
        self.emitted = [0] * len(references)  # updated by the stream callback
        self.rng = torch.Generator().manual_seed(seed)

    def stream(self, row: int, toks: list[int]) -> None:
        self.emitted[row] += len(toks)

    @property
    def reads(self) -> str:
        return self.inner.reads

    def check_head(self, head) -> None:
        self.inner.check_head(head)

    def prepare(self, *args, **kwargs) -> None:
        self.inner.prepare(*args, **kwargs)

    def begin(self, prompts, first) -> None:
        self.inner.begin(prompts, first)

    def observe(self, info) -> None:
        self.inner.observe(info)

    def draft(self, drafter, params=None, generator=None) -> Tree:
        tree = self.inner.draft(drafter, params, generator)
        tokens = tree.tokens.clone()
        for b, ref in enumerate(self.refs):
            base = self.emitted[b] - 1  # index in ref of the root token
            good = {0}
            for c in range(1, tree.size):
                p, d = int(tree.parents[b, c]), int(tree.depth[b, c])
                if p in good and base + d < len(ref) and float(torch.rand((), generator=self.rng)) < self.p_hit:
                    tokens[b, c] = ref[base + d]
                    good.add(c)
        return tree.with_tokens(tokens)


def random_calibration(seed: int, depth: int = 4, map: str = "isotonic"):
    """Random non-decreasing per-depth tables, including flat stretches at 1 and at the floor, and random power maps
    (scale e^a up to e: saturating at 1 from some q on; exponent 0.3-2); ``map`` says which one applies."""
    from treedec.tree.calibration import FLOOR, GRID, Calibration

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(depth):
        v = torch.rand(len(GRID), generator=g).sort().values
        v[: int(torch.randint(0, 3, (1,), generator=g))] = FLOOR
        v[len(GRID) - int(torch.randint(0, 4, (1,), generator=g)):] = 1.0
        rows.append(v.clamp(FLOOR, 1.0).tolist())
    power = [[float(torch.rand(1, generator=g)) * 1.5 - 0.5, 0.3 + 1.7 * float(torch.rand(1, generator=g))]
             for _ in range(depth)]
    return Calibration(rows, power=power, map=map)


def save_tiny_stack(root: Path, tokenizer_dir, seed: int = 0) -> Transformer:
    """A random tiny target (context 256) in ``root / "target"`` with ``tokenizer_dir``'s tokenizer and an untrained
    head for it in ``root / "draft"``: the checkpoint pair the CLI tests (generate, regenerate, bench) load."""
    from treedec.models.checkpoint import save_pretrained

    torch.manual_seed(seed)
    target = Transformer(LlamaConfig(**{**TINY_ARCH, "max_position_embeddings": 256}), "sdpa")
    save_pretrained(target, root / "target", tokenizer=str(tokenizer_dir))
    build_head(DraftConfig.for_target(target.config)).save(root / "draft")
    return target


def generate_overrides(stack: Path, run_dir, *extra) -> list[str]:
    """``python -m treedec.generate``'s overrides for the ``stack`` fixture's checkpoints: 24 tokens of one prompt."""
    return [f"model.path={stack / 'target'}", "model.dtype=float32", f"draft.path={stack / 'draft'}",
            "max_new_tokens=24", f"paths.run_dir={run_dir}", "prompt='def add(a, b):'", *extra]


def write_corpus(root: Path, n: int = 40) -> Path:
    """A synthetic ``*.py`` corpus: ``n`` modules, plus files the listing must skip and one invalid UTF-8 file."""
    for i in range(n):
        d = root / ("pkg" if i % 2 else "") / f"mod{i}.py"
        d.parent.mkdir(parents=True, exist_ok=True)
        d.write_text(textwrap.dedent(f'''\
            """Module {i}."""
            import os


            def add_{i}(a, b):
                """Add two numbers."""
                return a + b + {i}


            class Thing{i}:
                def __init__(self, value):
                    self.value = value

                def get(self):
                    return self.value * {i % 7}
            '''))
    for skipped in ("test/test_x.py", "tests/test_y.py", "site-packages/z.py", "idlelib/idle_test/t.py"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("SKIPPED = True\n")
    (root / "bad.py").write_bytes(b"x = '\xff\xfe'\n")  # invalid utf-8 is replaced, not fatal
    return root


class CheapDrafts:
    """A step-cost model for tree=auto in which drafting is nearly free and the verify flat, whatever this machine's
    load: chains and trees pay even for a random draft, and the shapes chosen are the same every run."""

    def __init__(self, policy):
        self.shapes = policy.shapes

    def seconds(self, rows):
        import numpy as np

        return np.array([1.0 + 0.001 * d + 0.0001 * t for _, d, t in self.shapes])

    def observe(self, rows, shape, seconds):
        pass


def with_cheap_drafts(policy):
    """``policy`` (tree=auto) deciding by :class:`CheapDrafts` instead of a profile of this machine."""
    policy.prepare = lambda *args, **kwargs: setattr(policy, "cost", CheapDrafts(policy))
    return policy
