"""The resident backbone's tokenizer, built here (nothing downloaded).

Byte-level BPE with the Qwen chat and vision special tokens: either one token
per UTF-8 byte (``build_tokenizer``) or merges learned from the instructions the
service meets (``train_tokenizer`` over ``instruction_corpus()``: the ManiSkill
tasks' and LIBERO-style instructions), deterministic for a given corpus.

See docs/ARCHITECTURE.md, "Policies that learn".
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from joynexus.schemas.errors import InvalidSpec

__all__ = [
    "LIBERO_STYLE_INSTRUCTIONS",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "build_tokenizer",
    "instruction_corpus",
    "train_tokenizer",
]

PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD_TOKEN,
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE: id i (0..255) is byte i, no merges, then the special tokens."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token="<|im_end|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    return fast


#: LIBERO-style instructions (written here; the suites' own task strings are in this
#: style), next to the ManiSkill tasks' instructions in the corpus the BPE learns from.
LIBERO_STYLE_INSTRUCTIONS: tuple[str, ...] = (
    "put the black bowl on the plate",
    "put the black bowl on top of the cabinet",
    "put the bowl on the stove",
    "put the bowl on the plate",
    "put the wine bottle on top of the cabinet",
    "put the wine bottle on the rack",
    "put the cream cheese in the bowl",
    "put the ketchup in the basket",
    "put the tomato sauce in the basket",
    "put the butter in the basket",
    "put the milk in the basket",
    "put the orange juice in the basket",
    "put the alphabet soup in the basket",
    "put the chocolate pudding to the right of the plate",
    "put the white mug on the left plate",
    "put the yellow and white mug in the microwave",
    "put both the alphabet soup and the tomato sauce in the basket",
    "put both moka pots on the stove",
    "open the middle drawer of the cabinet",
    "open the top drawer and put the bowl inside",
    "close the top drawer of the cabinet",
    "close the microwave",
    "turn on the stove",
    "turn off the stove and put the moka pot on it",
    "pick up the black bowl between the plate and the ramekin and place it on the plate",
    "pick up the black bowl next to the cookie box and place it on the plate",
    "pick up the black bowl on the wooden cabinet and place it on the plate",
    "pick up the alphabet soup and place it in the basket",
    "pick up the salad dressing and place it in the basket",
    "pick up the book and place it in the back compartment of the caddy",
    "push the plate to the front of the stove",
    "stack the black bowl on the other black bowl",
    "stack the left bowl on the right bowl and place them in the tray",
    "move the red cube to the left of the blue block",
    "slide the green block to the target on the table",
    "lift the cube and hold it above the table",
    "place the red cube on the green cube",
    "grasp the handle and pull the drawer open",
    "rotate the valve to the right",
    "insert the peg into the hole",
)


def instruction_corpus(extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """What the BPE learns its merges from: the ManiSkill tasks' instructions, the
    LIBERO-style ones above and ``extra`` (e.g. a dataset's task strings)."""
    from joynexus.agents.envs.maniskill import TASKS  # lazy: a plain dict of task facts

    out = [info.instruction for info in TASKS.values()] + list(LIBERO_STYLE_INSTRUCTIONS)
    out += [str(t) for t in extra]
    return list(dict.fromkeys(out))


def train_tokenizer(corpus: list[str] | None = None, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """A byte-level BPE with merges, trained here with ``tokenizers`` (nothing downloaded).

    The base alphabet is all 256 bytes, so any text still tokenizes (unseen words
    fall back to smaller pieces, down to single bytes); words of the corpus
    become single tokens. Deterministic for a given corpus (ties between equal
    pair counts are broken by the pair's ids, and the 256 byte symbols are
    numbered in sorted order), so every process building the same base gets the
    same ids. The special tokens follow the learned vocabulary.
    """
    if vocab_size < 257:
        raise InvalidSpec(f"train_tokenizer vocab_size={vocab_size}: must exceed the 256 byte symbols")
    texts = corpus if corpus is not None else instruction_corpus()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeated a few times so a word seen once still earns its merges (min_frequency 2).
    tok.train_from_iterator([t for t in texts for _ in range(2)], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token="<|im_end|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
