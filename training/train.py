#!/usr/bin/env python3
"""Train kvslim's bundled tiny Qwen3.5-style model on the CPU.

The model is a ``transformers`` ``Qwen3_5ForCausalLM`` (model_type
``qwen3_5_text``): Gated DeltaNet ("linear_attention") and gated attention
("full_attention") layers 3:1, like the real Qwen3.5/3.6 targets, only tiny.

Data: the offline English corpus of ``training/corpus.py`` (tokenized once and
cached under ``training/tokens/``), documents separated by ``<|endoftext|>``,
mixed with synthetic needle-retrieval samples from ``kvslim/eval/needle.py``
whose answer tokens get a larger loss weight.  Every batch is a pure function
of ``(seed, step)``, so a checkpoint only needs the step to resume the data
stream exactly; checkpoints also keep model, optimizer and RNG states.

Usage (see kvslim/data/tiny-qwen35/README.md for the run that made the model)::

    .venv/bin/python training/tokenizer.py
    .venv/bin/python training/train.py --bench                 # throughput table
    .venv/bin/python training/train.py --name tiny-qwen35      # full run + export
    .venv/bin/python training/train.py --name tiny-qwen35 --resume
    .venv/bin/python training/train.py --name tiny-qwen35 --export-only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

TRAINING_DIR = Path(__file__).resolve().parent
REPO_ROOT = TRAINING_DIR.parent
sys.path.insert(0, str(TRAINING_DIR))
sys.path.insert(0, str(REPO_ROOT))

import corpus  # noqa: E402
from kvslim.eval import haystack, needle  # noqa: E402

NEEDLE_KINDS = list(needle.KINDS)   # the row-kind index that batches carry

T_PROCESS = time.time()
TOKENS_DIR = TRAINING_DIR / "tokens"
RUNS_DIR = TRAINING_DIR / "runs"
EXPORT_DIR = REPO_ROOT / "kvslim" / "data" / "tiny-qwen35"
TOKENIZER_PATH = TRAINING_DIR / "tokenizer.json"
EOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# ---------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------


def parse_phases(text: str) -> list[tuple[int, float]]:
    """'1024:0.5,2048:0.25,4096:0.25' -> [(1024, 0.6), ...] (fractions of steps)."""
    phases = []
    for part in text.split(","):
        length, frac = part.split(":")
        phases.append((int(length), float(frac)))
    total = sum(f for _, f in phases)
    return [(n, f / total) for n, f in phases]


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line's value in /proc/cpuinfo (None where there is none, as off Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name, logged with a run: its step times only compare on the same CPU."""
    return _cpuinfo("model name") or platform.processor() or "unknown CPU"


def cpu_has_native_bf16() -> bool | None:
    """Whether the CPU does bf16 arithmetic itself (AVX512_BF16 or AMX); None if unknown. Without
    it bf16 autocast is emulated: 1.8x slower than fp32 per step on an Intel Xeon without it
    (`train.py --bench`, 4,096 tokens); the AMD EPYC machines of earlier runs have AVX512_BF16."""
    flags = _cpuinfo("flags")
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def parse_fill(text: str) -> tuple[float, float]:
    """'0.8:1.0' -> (0.8, 1.0): the range a needle row's haystack share is drawn from."""
    try:
        lo, hi = (float(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"expected LO:HI such as 0.8:1.0, got {text!r}") from None
    if not 0.0 < lo <= hi <= 1.0:
        raise ValueError(f"need 0 < LO <= HI <= 1, got {text!r}")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train the bundled tiny Qwen3.5-style model.")
    p.add_argument("--name", default="tiny-qwen35", help="run name (training/runs/<name>/)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda")
    p.add_argument("--workers", type=int, default=-1,
                   help="data-loading processes (-1: 0 on a CPU, 8 with a GPU)")
    # model
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8, help="multiple of 4 (3 DeltaNet + 1 attention)")
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--lin-k-heads", type=int, default=2)
    p.add_argument("--lin-v-heads", type=int, default=4)
    p.add_argument("--lin-head-dim", type=int, default=64)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    # optimisation
    p.add_argument("--steps", type=int, default=650,
                   help="optimizer steps; 0 with --budget-minutes: as many as fit")
    p.add_argument("--budget-minutes", type=float, default=0.0,
                   help="with --steps 0: time a few steps per phase, then pick the step "
                        "count that fits (logged, so --steps N replays the run)")
    p.add_argument("--tokens-per-step", type=int, default=8192)
    p.add_argument("--phases", default="1024:0.5,2048:0.25,4096:0.25",
                   help="sequence-length curriculum as len:fraction-of-steps")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 autocast for matmuls (master weights stay fp32)")
    # data mixture
    p.add_argument("--needle-frac", type=float, default=0.35,
                   help="share of sequences that are synthetic retrieval samples")
    p.add_argument("--answer-weight", type=float, default=10.0,
                   help="loss weight of needle answer tokens (others: 1)")
    p.add_argument("--text-weight", type=float, default=1.0,
                   help="loss weight of the tokens that are not needle answers (0 with --train-only: "
                        "tune a few parameters for retrieval alone, the text's loss only logged)")
    p.add_argument("--answer-stop", default="",
                   help='text after a needle answer, weighted like it (e.g. "." so that the model '
                        "learns where the number ends; empty: the answer is followed by end-of-text)")
    p.add_argument("--kinds", default="",
                   help="needle kind weights as kind:weight,... (kinds not named weigh 0; empty: "
                        "kvslim.eval.needle.KINDS). magic_many (5-10 keyed facts) is only drawn when named")
    p.add_argument("--asks", type=int, default=1,
                   help="questions per keyed needle sample, each followed by its weighted answer "
                        "(1: one question, as evaluation asks)")
    p.add_argument("--fill", default="0.2:1.0",
                   help="LO:HI, the share of a needle row that its haystack fills, drawn uniformly "
                        "(the rest is other text before it); 0.8:1.0 makes most needles sit far "
                        "from their question, as in an evaluation haystack of the full length")
    p.add_argument("--canonical", action="store_true",
                   help="needle rows use each kind's evaluation phrasing (the pass-key grid's "
                        "'The pass key is N. Remember it. N is the pass key.') instead of drawn ones; "
                        "for mining and drilling the phrasing that evaluation scores")
    p.add_argument("--copy-frac", type=float, default=0.0,
                   help="share of sequences of real text in which 1-4 spans are repeated "
                        "later in the window (dense practice for the copy step of retrieval)")
    p.add_argument("--source-power", type=float, default=0.5,
                   help="source sampling weight = (train tokens)^power")
    # bookkeeping
    p.add_argument("--eval-every", type=int, default=100, help="held-out loss every N steps")
    p.add_argument("--ckpt-minutes", type=float, default=10.0)
    p.add_argument("--grad-checkpoint", action="store_true",
                   help="recompute each layer's activations in the backward pass: ~1/3 more compute, "
                        "far less memory (a 32K-token step in bf16 peaks above 24 GiB without it)")
    p.add_argument("--train-only", default="",
                   help="regex: train only the parameters whose names it matches (re.search), the rest "
                        "frozen; e.g. 'layers\\.3\\.self_attn\\.[qk]_norm' tunes the first attention "
                        "layer's query/key norms, its attention temperature (empty: train everything)")
    p.add_argument("--mine", type=Path, default=None, metavar="FILE",
                   help="score steps 0..--steps-1 of this mixture without training (no gradient) and "
                        "write each step's answer loss and whether every answer token is the argmax "
                        "as JSON lines to FILE (after a line of the options that drew the rows); "
                        "--steps-from then trains on the hard ones and refuses other row options")
    p.add_argument("--steps-from", nargs="+", default=None, metavar="FILE[@SEED]",
                   help="train on the batches listed in these files, in order and cycling: a --mine "
                        "output (.jsonl: its hard rows, each followed by an easy one) or a JSON list of "
                        "step numbers (drawn under --seed) or [seed, step] pairs, with the same mixture "
                        "options as the --mine runs that found them; @SEED names the seed of a --mine "
                        "file that predates the seed in its rows")
    p.add_argument("--resume", action="store_true", help="continue from runs/<name>/ckpt/last.pt")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from the weights (not optimizer/step) of a checkpoint; "
                        "for a continued run with a different mixture")
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="hard wall-clock limit: stop early with a checkpoint (and --save-weights) "
                        "when it is reached, e.g. on a machine lent for a fixed time")
    p.add_argument("--stop-at", type=int, default=0,
                   help="stop after this step with a checkpoint and no export (to replay a "
                        "run that was resumed with changed options; see the model card)")
    p.add_argument("--save-weights", type=Path, default=None,
                   help="also write the final fp32 weights here as safetensors shards of "
                        "at most 15 MB (to carry them off a lent machine)")
    p.add_argument("--export-only", action="store_true")
    p.add_argument("--export-dir", type=Path, default=EXPORT_DIR)
    p.add_argument("--no-export", action="store_true")
    p.add_argument("--bench", action="store_true",
                   help="measure training tokens/s (fp32 vs bf16, several lengths) and exit")
    p.add_argument("--bench-lengths", default="1024,2048,4096")
    return p


def model_config(args):
    from transformers import Qwen3_5TextConfig

    if args.layers % 4:
        raise SystemExit("--layers must be a multiple of 4")
    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (args.layers // 4)
    return Qwen3_5TextConfig(
        vocab_size=8192,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        layer_types=layer_types,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        linear_num_key_heads=args.lin_k_heads,
        linear_num_value_heads=args.lin_v_heads,
        linear_key_head_dim=args.lin_head_dim,
        linear_value_head_dim=args.lin_head_dim,
        linear_conv_kernel_dim=4,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta,
                         "partial_rotary_factor": 0.25},
        initializer_range=0.02,
        attention_dropout=0.0,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        use_cache=True,
    )


def build_model(args):
    from transformers import Qwen3_5ForCausalLM

    config = model_config(args)
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    model = Qwen3_5ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


def count_params(model) -> int:
    """Unique parameters (the tied embedding counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------


def load_tokenizer():
    from tokenizers import Tokenizer

    if not TOKENIZER_PATH.exists():
        raise SystemExit("training/tokenizer.json missing: run .venv/bin/python training/tokenizer.py")
    return Tokenizer.from_file(str(TOKENIZER_PATH))


def tokenizer_digest() -> str:
    return hashlib.sha256(TOKENIZER_PATH.read_bytes()).hexdigest()[:16]


def ensure_corpus() -> list[str]:
    """Names of the corpus sources (running corpus.py if files are missing).

    A copy of the corpus may travel without its training text (to a GPU
    machine that cannot reach Debian, see gpu_train.sh): then the sources are
    those whose cached training tokens are here.
    """
    def sources(folder: Path, suffix: str) -> list[str]:
        return sorted(p.name[: -len(suffix)] for p in folder.glob("*" + suffix))

    names = (sources(corpus.DEFAULT_DATA_DIR, ".train.txt")
             or sources(TOKENS_DIR, f".train.{tokenizer_digest()}.npy"))
    if not names:
        import subprocess
        subprocess.run([sys.executable, str(TRAINING_DIR / "corpus.py")], check=True)
        names = sources(corpus.DEFAULT_DATA_DIR, ".train.txt")
    return names


def token_cache(source: str, split: str, tok) -> np.ndarray:
    """Token ids of one source/split, each document followed by <|endoftext|>.

    Cached as training/tokens/<source>.<split>.<tokenizer digest>.npy.
    """
    TOKENS_DIR.mkdir(parents=True, exist_ok=True)
    path = TOKENS_DIR / f"{source}.{split}.{tokenizer_digest()}.npy"
    if path.exists():
        return np.load(path)
    docs = corpus.read_documents(corpus.DEFAULT_DATA_DIR / f"{source}.{split}.txt")
    pieces = []
    for enc in tok.encode_batch(docs):
        pieces.append(np.asarray(enc.ids + [EOS_ID], dtype=np.uint16))
    arr = np.concatenate(pieces)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, arr)
    tmp.replace(path)
    return arr


class DataMixture:
    """Deterministic batches: batch(step) depends only on (seed, step, shape)."""

    def __init__(self, args, tok, streams: dict[str, np.ndarray] | None = None):
        """``streams`` (source -> train tokens) replaces the corpus' token caches (tests)."""
        self.args = args
        self.tok = tok
        if streams is None:
            self.sources = ensure_corpus()
            self.train = {s: token_cache(s, "train", tok) for s in self.sources}
            self.heldout = {s: token_cache(s, "heldout", tok) for s in self.sources}
        else:
            self.sources, self.train, self.heldout = sorted(streams), dict(streams), dict(streams)
        # Needles are spliced into token windows by kvslim.eval.haystack, as kvslim eval ruler builds them.
        self.space = haystack.TokenSpace(self._encode, tok.decode, tok.get_vocab_size())
        self.kinds = needle.parse_kinds(args.kinds) if args.kinds else None
        self.fill = parse_fill(args.fill)
        sizes = np.array([len(self.train[s]) for s in self.sources], dtype=np.float64)
        weights = sizes ** args.source_power
        self.weights = (weights / weights.sum()).tolist()

    def count_tokens(self, text: str) -> int:
        return len(self.tok.encode(text).ids)

    def _window(self, rng: random.Random, length: int) -> tuple[str, np.ndarray]:
        source = rng.choices(self.sources, weights=self.weights)[0]
        stream = self.train[source]
        start = rng.randrange(0, len(stream) - length)
        return source, stream[start:start + length].astype(np.int64)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def _needle_row(self, rng: random.Random, length: int,
                    kind: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """length+1 tokens ending with a retrieval sample, and their loss weights.

        Built in token space by kvslim.eval.haystack (filler is a window of the token
        stream, needles go in after a sentence end), with the phrasings of kvslim.eval.needle.
        """
        return haystack.needle_row(self.space, rng, length, lambda r, n: self._window(r, n)[1], EOS_ID,
                                   self.args.answer_weight, self.args.answer_stop, self.kinds, self.args.asks,
                                   kind, self.fill, self.args.canonical)

    def _copy_row(self, rng: random.Random, length: int) -> tuple[np.ndarray, np.ndarray]:
        """A window of real text with 1-4 of its spans repeated further on.

        Every token of a repeat after its first is predictable only by finding
        the earlier copy and reading what followed it: the same look-up that a
        needle question needs, but with hundreds of targets per row instead of
        a handful of answer digits.
        """
        _, ids = self._window(rng, length + 1)
        copied = np.zeros(length + 1, dtype=bool)
        for _ in range(rng.randint(1, 4)):
            span = rng.randint(8, max(8, min(128, length // 8)))
            src = rng.randrange(0, length + 1 - 2 * span)
            dst = rng.randrange(src + span, length + 2 - span)
            ids[dst:dst + span] = ids[src:src + span].copy()
            copied[dst + 1:dst + span] = True  # the first token of a repeat is a guess
        return ids, copied

    def batch(self, step: int, seq_len: int, batch_size: int, seed: int | None = None):
        """(inputs, targets, target weights, answer mask, copy mask, row kinds) for one step.

        Row kinds index ``NEEDLE_KINDS`` (-1: a row without a needle), so that the log can
        say which kinds of answer the model gets right.
        """
        rows, wts, copies, kinds = [], [], [], []
        for row in range(batch_size):
            rng = random.Random(f"{self.args.seed if seed is None else seed}:{step}:{row}")
            draw = rng.random()
            copied = np.zeros(seq_len + 1, dtype=bool)
            kinds.append(-1)
            if draw < self.args.needle_frac:
                kind = needle.sample_kind(rng, self.kinds)   # the draw needle_row would make
                kinds[-1] = NEEDLE_KINDS.index(kind)
                ids, w = self._needle_row(rng, seq_len, kind)
            elif draw < self.args.needle_frac + self.args.copy_frac:
                ids, copied = self._copy_row(rng, seq_len)
                w = np.ones(seq_len + 1, dtype=np.float32)
            else:
                _, ids = self._window(rng, seq_len + 1)
                w = np.ones(seq_len + 1, dtype=np.float32)
            rows.append(ids)
            wts.append(w)
            copies.append(copied)
        ids = torch.from_numpy(np.stack(rows))
        w = torch.from_numpy(np.stack(wts))[:, 1:]
        answer = w > 1.0
        w = torch.where(answer, w, w * self.args.text_weight)
        copied = torch.from_numpy(np.stack(copies))[:, 1:]
        return (ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), w.contiguous(), answer,
                copied.contiguous(), torch.tensor(kinds, dtype=torch.int64))

    def heldout_windows(self, length: int = 1024, per_source: int = 2):
        """Fixed held-out windows (same every evaluation) per source."""
        out = {}
        for s in self.sources:
            stream = self.heldout[s]
            n = min(per_source, max(1, (len(stream) - 1) // length))
            starts = np.linspace(0, len(stream) - length - 1, n).astype(np.int64)
            out[s] = torch.from_numpy(np.stack([stream[i:i + length + 1].astype(np.int64)
                                                for i in starts]))
        return out


# ---------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------


def phase_at(step: int, args) -> int:
    phases = parse_phases(args.phases)
    edge = 0.0
    for length, frac in phases:
        edge += frac * args.steps
        if step < round(edge):
            return length
    return phases[-1][0]


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def autocast(args):
    device = getattr(args, "device_type", "cpu")
    return torch.autocast(device, dtype=torch.bfloat16, enabled=bool(args.bf16))


def forward_loss(model, args, inputs, targets, weights):
    with autocast(args):
        hidden = model.model(input_ids=inputs).last_hidden_state
        logits = model.lm_head(hidden)
    ce = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1),
                         reduction="none").view(targets.shape)
    loss = (ce * weights).sum() / weights.sum().clamp_min(1e-6)   # a row of zero weights: no gradient
    return loss, ce, logits


def answer_exact(answer: torch.Tensor, correct: torch.Tensor) -> float:
    """Share of answers (runs of adjacent answer tokens in a row) predicted right in every token.

    Per-token accuracy hides a model that gets the digits keys share right and the look-up
    wrong (run keys: 0.949 per token, 0/6 keys found); a whole answer counts only when exact.
    """
    starts = answer & ~F.pad(answer[:, :-1], (1, 0))
    n = int(starts.sum())
    if n == 0:
        return float("nan")
    span = (torch.cumsum(starts.flatten(), 0) - 1)[answer.flatten()]
    misses = torch.zeros(n, device=answer.device).index_add_(0, span, (~correct[answer]).float())
    return (misses == 0).float().mean().item()


def answer_exact_by_kind(answer: torch.Tensor, correct: torch.Tensor, row_kinds: torch.Tensor) -> dict:
    """``answer_exact_<kind>`` for every needle kind in the batch: a mixed figure hides a
    model that looks keys up well and copies pass keys badly (run keys4: 0.87 mixed)."""
    out = {}
    for index in row_kinds[row_kinds >= 0].unique().tolist():
        rows = row_kinds == index
        out[f"answer_exact_{NEEDLE_KINDS[index]}"] = answer_exact(answer[rows], correct[rows])
    return out


@torch.no_grad()
def heldout_loss(model, args, windows) -> dict:
    model.eval()
    out = {}
    device = next(model.parameters()).device
    for source, ids in windows.items():
        ids = ids.to(device)
        with autocast(args):
            logits = model(input_ids=ids[:, :-1]).logits
        out[source] = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                      ids[:, 1:].reshape(-1)).item()
    out["mean"] = sum(out.values()) / len(out)
    model.train()
    return out


def resolve_device(args) -> torch.device:
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    device = torch.device(name)
    args.device_type = device.type
    if args.workers < 0:
        args.workers = 8 if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    return device


class StepBatches(torch.utils.data.Dataset):
    """Batches of steps first..last-1, so that worker processes build them ahead."""

    def __init__(self, data, args, first: int, last: int):
        self.data, self.args, self.first, self.last = data, args, first, last

    def __len__(self):
        return self.last - self.first

    def __getitem__(self, i):
        step = self.first + i
        seq_len = phase_at(step, self.args)
        draws = getattr(self.args, "draws", None)
        seed, draw = draws[step % len(draws)] if draws else (None, step)
        return self.data.batch(draw, seq_len, max(1, self.args.tokens_per_step // seq_len), seed)


def batches(data, args, first: int, last: int):
    loader = torch.utils.data.DataLoader(
        StepBatches(data, args, first, last), batch_size=None, shuffle=False,
        num_workers=args.workers, pin_memory=args.device_type == "cuda",
        prefetch_factor=4 if args.workers else None, persistent_workers=False)
    return iter(loader)


def freeze_except(model, pattern: str) -> int:
    """Freeze the parameters whose names ``pattern`` does not match; the number left trainable.

    Frozen layers below the first trainable one then run without autograd records, so a step
    costs little more than their forward pass."""
    try:
        regex = re.compile(pattern)
    except re.error as err:
        raise SystemExit(f"--train-only: not a regular expression: {err}") from None
    kept = 0
    for name, p in model.named_parameters():
        p.requires_grad_(bool(regex.search(name)))
        kept += p.numel() if p.requires_grad else 0
    if not kept:
        raise SystemExit(f"--train-only {pattern!r} matches no parameter (names look like "
                         f"{next(n for n, _ in model.named_parameters())!r})")
    return kept


def make_optimizer(model, args):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def save_checkpoint(path: Path, model, opt, step: int, tokens: int, elapsed: float, args):
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": step,              # next step to run; the data stream is a function of it
        "tokens": tokens,
        "elapsed": elapsed,
        "args": vars(args),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": np.random.get_state()},
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def load_initial_weights(model, path: Path) -> str:
    """Weights (not optimizer or step) from a checkpoint .pt, or from a folder
    of safetensors files (an exported model, or --save-weights shards)."""
    if path.is_dir():
        from safetensors.torch import load_file

        from kvslim.loading.hf import safetensors_files  # the weights, not the KV calibration
        try:
            files = safetensors_files(path)
        except ValueError as err:
            raise SystemExit(f"--init-from: {err}") from None
        state = {}
        for f in files:
            state.update(load_file(f))
        if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied
        model.load_state_dict({k: v.float() for k, v in state.items()})
        return f"{path} ({len(files)} files)"
    state = torch.load(path, weights_only=False, map_location="cpu")
    model.load_state_dict(state["model"])
    return f"{path} (step {state['step']})"


def save_weight_shards(model, out: Path, limit: int = 15_000_000) -> None:
    """fp32 weights as safetensors files of at most `limit` bytes each."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    shard, size, index = {}, 0, 0
    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}  # tied to the embedding
    for name, tensor in state.items():
        nbytes = tensor.numel() * 4
        if shard and size + nbytes > limit:
            save_file(shard, str(out / f"weights-{index:02d}.safetensors"))
            shard, size, index = {}, 0, index + 1
        shard[name], size = tensor, size + nbytes
    save_file(shard, str(out / f"weights-{index:02d}.safetensors"))


def plan_steps(model, opt, data, args, device) -> int:
    """Steps that fit --budget-minutes, from timed steps at every phase length.

    The timed steps change the weights, so the caller rebuilds model and
    optimizer afterwards: the run itself is the same as one with --steps N.
    """
    per_token = []
    for length, frac in parse_phases(args.phases):
        bs = max(1, args.tokens_per_step // length)
        times = []
        for i in range(4):
            inputs, targets, weights, *_ = (t.to(device) for t in data.batch(i, length, bs))
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.time()
            loss, _, _ = forward_loss(model, args, inputs, targets, weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.time() - t0)
        per_token.append((frac, min(times[1:])))
        print(f"[train] timing L={length} bs={bs}: {min(times[1:]):.3f} s/step", flush=True)
    seconds_per_step = sum(frac * t for frac, t in per_token) * 1.08  # evals, logging
    steps = int(args.budget_minutes * 60 / seconds_per_step)
    print(f"[train] {steps} steps fit {args.budget_minutes} min", flush=True)
    return max(steps, args.warmup + 1)


def train(args) -> None:
    from tqdm import tqdm

    if args.text_weight < 0:
        raise SystemExit(f"--text-weight must be >= 0, got {args.text_weight}")
    device = resolve_device(args)
    if device.type == "cpu" and args.bf16 and cpu_has_native_bf16() is False:
        print("[train] warning: this CPU has no AVX512_BF16 or AMX, so bf16 autocast is emulated and "
              "slower than fp32; --no-bf16 trains faster here (the numbers differ slightly)", flush=True)
    run_dir = RUNS_DIR / args.name
    ckpt_path = run_dir / "ckpt" / "last.pt"
    run_dir.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer()
    data = DataMixture(args, tok)
    if args.steps == 0:
        if args.budget_minutes <= 0:
            raise SystemExit("--steps 0 needs --budget-minutes")
        model = build_model(args).to(device).train()
        args.steps = plan_steps(model, make_optimizer(model, args), data, args, device)
        del model
    model = build_model(args).to(device)
    model.train()
    if args.grad_checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.train_only:
        print(f"[train] --train-only: {freeze_except(model, args.train_only)} parameters trainable", flush=True)
    opt = make_optimizer(model, args)
    step, tokens, elapsed = 0, 0, 0.0
    if args.resume:
        state = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, tokens, elapsed = state["step"], state["tokens"], state["elapsed"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        print(f"[train] resumed at step {step} ({tokens} tokens, {elapsed / 60:.1f} min)", flush=True)
        # Drop log records of steps after the checkpoint: they are run again.
        log_path = run_dir / "log.jsonl"
        if log_path.exists():
            kept = [line for line in log_path.read_text().splitlines()
                    if json.loads(line).get("step", 0) <= step or "event" in json.loads(line)]
            log_path.write_text("".join(line + "\n" for line in kept))
    elif args.init_from is not None:
        print(f"[train] weights from {load_initial_weights(model, args.init_from)}", flush=True)
        (run_dir / "log.jsonl").unlink(missing_ok=True)
    else:
        (run_dir / "log.jsonl").unlink(missing_ok=True)
    n_params = count_params(model)
    meta = {"event": "start", "step": step, "params": n_params, "cmdline": shlex.join(sys.argv[1:]),
            "args": {k: str(v) for k, v in vars(args).items()},
            "tokenizer_sha256": tokenizer_digest(), "sources": data.sources,
            "source_weights": data.weights, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "cpu": cpu_name(),
            "train_tokens": {s: int(len(a)) for s, a in data.train.items()}}
    log = open(run_dir / "log.jsonl", "a", encoding="utf-8")
    log.write(json.dumps(meta) + "\n")
    log.flush()
    print(f"[train] {n_params / 1e6:.2f}M parameters, {args.steps} steps, phases {args.phases}, "
          f"{meta['device']}", flush=True)
    windows = data.heldout_windows()
    last_ckpt = time.time()
    t_start = time.time() - elapsed
    bar = tqdm(total=args.steps, initial=step, dynamic_ncols=True, mininterval=5)
    stop = min(args.steps, args.stop_at) if args.stop_at else args.steps
    for batch in batches(data, args, step, stop):
        inputs, targets, weights, answer, copied, row_kinds = (t.to(device, non_blocking=True) for t in batch)
        seq_len = inputs.shape[1]
        lr = lr_at(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        t0 = time.time()
        loss, ce, logits = forward_loss(model, args, inputs, targets, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip).item()
        opt.step()
        dt = time.time() - t0
        step += 1
        tokens += inputs.numel()
        record = {"step": step, "seq_len": seq_len, "loss": loss.item(),
                  "lm_loss": ce[~(answer | copied)].mean().item(), "lr": lr, "grad_norm": grad_norm,
                  "tokens": tokens, "step_s": round(dt, 3),
                  "elapsed_s": round(time.time() - t_start, 1)}
        pred = logits.argmax(-1)
        if answer.any():
            record["answer_loss"] = ce[answer].mean().item()
            record["answer_acc"] = (pred[answer] == targets[answer]).float().mean().item()
            record["answer_exact"] = answer_exact(answer, pred == targets)
            record.update(answer_exact_by_kind(answer, pred == targets, row_kinds))
        if copied.any():
            record["copy_loss"] = ce[copied].mean().item()
            record["copy_acc"] = (pred[copied] == targets[copied]).float().mean().item()
        if step % args.eval_every == 0 or step == args.steps:
            record["heldout"] = heldout_loss(model, args, windows)
        log.write(json.dumps(record) + "\n")
        log.flush()
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", L=seq_len, tok_s=f"{inputs.numel() / dt:.0f}")
        out_of_time = args.max_minutes and time.time() - T_PROCESS > args.max_minutes * 60
        if (time.time() - last_ckpt > args.ckpt_minutes * 60 or step in (args.steps, stop)
                or out_of_time):
            save_checkpoint(ckpt_path, model, opt, step, tokens, time.time() - t_start, args)
            last_ckpt = time.time()
        if out_of_time:
            print(f"[train] --max-minutes reached at step {step}", flush=True)
            break
    bar.close()
    if args.save_weights is not None:
        save_weight_shards(model, args.save_weights)
    if step < args.steps:
        print(f"[train] stopped at step {step} of {args.steps}", flush=True)
        log.close()
        return
    log.write(json.dumps({"event": "end", "step": step, "tokens": tokens,
                          "elapsed_s": round(time.time() - t_start, 1)}) + "\n")
    log.close()
    if not args.no_export:
        export(args, model.cpu())


# ---------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------


def export(args, model=None) -> Path:
    """Write the Hugging Face folder (bf16 safetensors + tokenizer + configs)."""
    from transformers import GenerationConfig

    out = args.export_dir
    if model is None and args.init_from is not None:
        model = build_model(args)
        print(f"[export] weights from {load_initial_weights(model, args.init_from)}", flush=True)
    if model is None:
        state = torch.load(RUNS_DIR / args.name / "ckpt" / "last.pt", weights_only=False,
                           map_location="cpu")
        saved = argparse.Namespace(**state["args"])
        model = build_model(saved)
        model.load_state_dict(state["model"])
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "config.json", "generation_config.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "chat_template.jinja"):
        (out / stale).unlink(missing_ok=True)
    model = model.to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    model.config.use_cache = True
    model.generation_config = GenerationConfig(
        bos_token_id=EOS_ID, eos_token_id=[IM_END_ID, EOS_ID], pad_token_id=EOS_ID,
        do_sample=False, max_new_tokens=64)
    model.save_pretrained(out, safe_serialization=True)
    shutil.copyfile(TOKENIZER_PATH, out / "tokenizer.json")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "extra_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o644)  # save_pretrained leaves the weights owner-only
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"[export] {out} ({size / 1e6:.1f} MB)", flush=True)
    return out


# ---------------------------------------------------------------------------
# throughput benchmark
# ---------------------------------------------------------------------------


def bench(args) -> None:
    tok = load_tokenizer()
    data = DataMixture(args, tok)
    model = build_model(args)
    model.train()
    opt = make_optimizer(model, args)
    print(f"[bench] hidden {args.hidden} layers {args.layers} inter {args.intermediate}: "
          f"{count_params(model) / 1e6:.2f}M params, {args.tokens_per_step} tokens/step", flush=True)
    for bf16 in (False, True):
        args.bf16 = bf16
        for seq_len in (int(x) for x in args.bench_lengths.split(",")):
            bs = max(1, args.tokens_per_step // seq_len)
            times = []
            for i in range(3):
                inputs, targets, weights, *_ = data.batch(i, seq_len, bs)
                t0 = time.time()
                loss, _, _ = forward_loss(model, args, inputs, targets, weights)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                times.append(time.time() - t0)
                if sum(times) > 25:
                    break
            best = min(times[1:]) if len(times) > 1 else times[0]
            print(f"[bench] {'bf16' if bf16 else 'fp32'} L={seq_len} bs={bs}: "
                  f"{inputs.numel() / best:.0f} tok/s ({best:.2f} s/step)", flush=True)


# glibc returns large freed buffers to the kernel at once, so every step
# page-faults its activations back in (and fresh pages are slow on the VMs this
# was trained on): keep freed memory in the process instead.  Timing only;
# results are the same without it.
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=4294967296"


# The options that decide what a step's batch holds besides seed and step: a --mine file
# records them, and --steps-from refuses a run whose options would draw other rows.
ROW_OPTIONS = ("phases", "tokens_per_step", "needle_frac", "copy_frac", "kinds", "asks", "answer_weight",
               "answer_stop", "fill", "canonical", "source_power")


def row_options(args) -> dict:
    return {k: getattr(args, k) for k in ROW_OPTIONS}


# Row options given as text, by the parser that reads them: "0.9:1" and "0.9:1.0" draw the same rows
_ROW_PARSERS = {"phases": parse_phases, "fill": parse_fill,
                "kinds": lambda text: needle.parse_kinds(text) if text else None}


def same_rows(option: str, mined, ours) -> bool:
    """Whether a --mine file's value of a row option draws the rows this run's value draws."""
    parse = _ROW_PARSERS.get(option)
    if parse is None or not isinstance(mined, str) or not isinstance(ours, str):
        return mined == ours
    try:
        return parse(mined) == parse(ours)
    except ValueError:
        return mined == ours


def hard_rows(records: list[dict], max_loss: float = 0.3, seed: int = 0) -> list[int]:
    """Steps of a --mine file to train on: each hard one (an answer token read wrong, or one
    with loss above ``max_loss``: probability under 0.74 at 0.3) followed by an easy one drawn
    at random, so that the rows the model already reads keep their weight in the run.
    Rows that carry their mining run's seed come back as [seed, step] pairs."""
    seeds = {r["step"]: r["seed"] for r in records if "seed" in r and "step" in r}
    item = lambda step: [seeds[step], step] if step in seeds else step  # noqa: E731
    hard = [r["step"] for r in records if "answer_exact" in r
            and (r["answer_exact"] < 1 or r["answer_loss_max"] > max_loss)]
    easy = [r["step"] for r in records if "answer_exact" in r and r["step"] not in hard]
    random.Random(seed).shuffle(easy)
    return [item(step) for pair in zip(hard, sorted(easy[:len(hard)])) for step in pair]


def read_draws(parser, specs: list[str], args=None) -> list[tuple[int | None, int]]:
    """--steps-from: the batches to train on, as (seed, step) with seed None for --seed's.

    Each FILE is a --mine output (.jsonl: its hard rows, see hard_rows) or a JSON list whose
    items are step numbers (drawn under --seed) or [seed, step] pairs, so that one run can
    train on the rows of several mining runs. FILE@SEED gives a file's bare step numbers that
    seed (mine files written before rows carried their seed). Files are read in order.
    A --mine file that records its row options is refused when ``args`` would draw other rows."""
    draws = []
    for spec in specs:
        path, _, seed = str(spec).partition("@")
        if seed and not seed.isdigit():
            parser.error(f"--steps-from {spec}: the part after @ must be a seed (a whole number)")
        draws += [(int(seed) if seed and s is None else s, step)
                  for s, step in read_draw_file(parser, Path(path), args)]
    return draws


def read_draw_file(parser, path: Path, args=None) -> list[tuple[int | None, int]]:
    """One --steps-from file's (seed, step) draws (seed None: not named in the file)."""
    try:
        text = path.read_text()
        records = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" else None
        items = hard_rows(records) if records is not None else json.loads(text)
    except (OSError, ValueError, KeyError) as err:
        parser.error(f"--steps-from {path}: {err}")
    mined = next((r["options"] for r in records or [] if r.get("event") == "mine"), None)
    if args is not None and mined is not None:
        ours = row_options(args)
        for k in ROW_OPTIONS:
            if k in mined and not same_rows(k, mined[k], ours[k]):
                parser.error(f"--steps-from {path}: mined with --{k.replace('_', '-')} {mined[k]!r}, this run has "
                             f"{ours[k]!r}: the listed steps would be other rows")
    ok = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0  # noqa: E731
    if not isinstance(items, list) or not items:
        parser.error(f"--steps-from {path}: expected a non-empty JSON list (or a --mine file with hard rows)")
    draws = []
    for item in items:
        if ok(item):
            draws.append((None, item))
        elif isinstance(item, list) and len(item) == 2 and all(ok(x) for x in item):
            draws.append((item[0], item[1]))
        else:
            parser.error(f"--steps-from {path}: {item!r} is neither a step number nor a [seed, step] pair")
    return draws


@torch.no_grad()
def mine(args) -> None:
    """--mine: how the --init-from weights do on the retrieval answers of steps 0..--steps-1.

    Rows are drawn exactly as training would draw them (same seed, lengths, mixture), so a
    step number found hard here names a batch that --steps-from can train on."""
    if args.init_from is None:
        raise SystemExit("--mine needs --init-from: the weights to score")
    device = resolve_device(args)
    data = DataMixture(args, load_tokenizer())
    model = build_model(args).to(device)
    print(f"[mine] weights from {load_initial_weights(model, args.init_from)}", flush=True)
    model.eval()
    args.mine.parent.mkdir(parents=True, exist_ok=True)
    with open(args.mine, "w", encoding="utf-8") as out:
        out.write(json.dumps({"event": "mine", "seed": args.seed, "options": row_options(args)}) + "\n")
        for step, batch in enumerate(batches(data, args, 0, args.steps)):
            inputs, targets, weights, answer, _, _ = (t.to(device) for t in batch)
            t0 = time.time()
            _, ce, logits = forward_loss(model, args, inputs, targets, weights)
            record = {"step": step, "seed": args.seed, "seq_len": inputs.shape[1],
                      "seconds": round(time.time() - t0, 2)}
            if answer.any():
                record.update(answer_loss=ce[answer].mean().item(), answer_loss_max=ce[answer].max().item(),
                              answer_exact=answer_exact(answer, logits.argmax(-1) == targets))
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(f"[mine] step {step}: {record}", flush=True)


def main(argv=None) -> int:
    if argv is None and "GLIBC_TUNABLES" not in os.environ and sys.platform.startswith("linux"):
        os.environ["GLIBC_TUNABLES"] = MALLOC_TUNABLES
        os.execv(sys.executable, [sys.executable, *sys.argv])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.kinds:
        try:
            needle.parse_kinds(args.kinds)
        except ValueError as e:
            parser.error(f"--kinds: {e}")
    try:
        parse_fill(args.fill)
    except ValueError as e:
        parser.error(f"--fill: {e}")
    if args.asks < 1:
        parser.error(f"--asks must be at least 1, got {args.asks}")
    args.draws = read_draws(parser, args.steps_from, args) if args.steps_from else None
    torch.set_num_threads(args.threads)
    if args.bench:
        bench(args)
    elif args.mine:
        mine(args)
    elif args.export_only:
        export(args)
    else:
        train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
