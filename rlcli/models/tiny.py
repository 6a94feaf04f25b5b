"""The embedded tiny policy: a ~4M-parameter Llama over a shipped character-level tokenizer.

It needs no download, so `model=tiny` runs every algorithm offline on a laptop CPU. The tokenizer
lives in `rlcli/models/tokenizer/` (rebuild it with `python -m rlcli.models.tiny`); load it with
:func:`load_tiny_tokenizer`, never `AutoTokenizer` (docs/design.md#environment: for some architectures
AutoTokenizer swaps in its own class and spaces vanish from a char vocab).

The tokenizer adds no special tokens on its own: callers append `</s>` to targets explicitly, and
prompts start without `<s>`. One character is one token, so `len(text)` is the token count.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlcli.models.config import CHARS, SPECIAL_TOKENS, TOKENIZER_DIR, TinyModelConfig

MODEL_MAX_LENGTH = 512


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer from scratch (what the shipped files contain)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character is its own pre-token; [\s\S] (not '.') so newlines are split off too.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins tokens with no separator, so spaces and newlines round-trip exactly.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
    )


def save_tiny_tokenizer(
    out_dir: str | Path = TOKENIZER_DIR, tokenizer: PreTrainedTokenizerFast | None = None
) -> Path:
    """Write `tokenizer` (default: a fresh build, i.e. the shipped files) into `out_dir`.

    transformers 5 records its backend class name ('TokenizersBackend'), which transformers 4
    cannot load and rlcli.models.load_tokenizer does not recognise; we record the portable
    'PreTrainedTokenizerFast', which both versions load with the same class.
    """
    out_dir = Path(out_dir)
    (tokenizer or build_tiny_tokenizer()).save_pretrained(str(out_dir))
    config_file = out_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def load_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Load the shipped character tokenizer (no automatic BOS/EOS; padding side set by callers)."""
    return PreTrainedTokenizerFast.from_pretrained(str(TOKENIZER_DIR))


def build_tiny_model(
    cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int
) -> LlamaForCausalLM:
    """A randomly initialised Llama sized by `cfg`, with vocab and special ids from `tokenizer`.

    Seeded locally (fork_rng), so building a model does not move the caller's RNG stream.
    """
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation=cfg.attn_implementation,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Rebuild the shipped tiny tokenizer files.")
    parser.add_argument("--out", default=str(TOKENIZER_DIR), help="output directory")
    print(f"wrote {save_tiny_tokenizer(parser.parse_args().out)}")
