"""Tokenizers for the families: the Llama 3 tokenizer (GPU family) or a byte-level BPE trained
here on the corpus (CPU family), and the tokenizer files written beside each model.

Both carry Llama 3's special tokens, so both use Llama 3.1's chat template (the copy Harrier's
model generator ships: engine-core/src/gen_model/llama31_chat_template.jinja). Documents are
encoded as <|begin_of_text|> text <|end_of_text|>.
"""

import json
import os

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TEMPLATE = os.path.join(REPO, "engine-core", "src", "gen_model", "llama31_chat_template.jinja")
# Llama 3's special tokens that its chat template and tool format use, in Llama 3's order.
SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
]
BOS, EOS_TEXT, EOT, EOM = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"
# The BPE learns from the first TOKENIZER_TRAIN_BYTES of the training split (in corpus order).
TOKENIZER_TRAIN_BYTES = 24 << 20


def train_bpe(corpus, vocab_size):
    """A byte-level BPE (GPT-2/Llama 3 style pre-tokenization) with SPECIALS as ids 0..10."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        used = 0
        for _, text in corpus.train:
            if used >= TOKENIZER_TRAIN_BYTES:
                return
            used += len(text.encode())
            yield text

    tok.train_from_iterator(texts(), trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)])
    return tok


def load(path):
    return Tokenizer.from_file(path)


def special_ids(tok):
    """Ids of BOS, <|end_of_text|>, <|eot_id|> (required) and <|eom_id|> (None where absent:
    Llama 3.0's tokenizer, which the GPU family uses, names that id a reserved token)."""
    ids = {name: tok.token_to_id(name) for name in (BOS, EOS_TEXT, EOT, EOM)}
    missing = [k for k, v in ids.items() if v is None and k != EOM]
    if missing:
        raise SystemExit(f"tokenizer lacks the special tokens {missing}")
    return ids


def encode_docs(tok, docs):
    """All documents as one uint32 stream: BOS ids EOS per document."""
    sp = special_ids(tok)
    encs = tok.encode_batch([t for _, t in docs], add_special_tokens=False)
    parts = []
    for e in encs:
        parts.append(np.array([sp[BOS]] + e.ids + [sp[EOS_TEXT]], dtype=np.uint32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


def write_files(tok, out_dir, model_max_length):
    """tokenizer.json and a tokenizer_config.json as Llama 3.1 Instruct's (bos, eos, template)."""
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {}
    for t in json.load(open(os.path.join(out_dir, "tokenizer.json")))["added_tokens"]:
        added[str(t["id"])] = {k: t.get(k, False) for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
    config = {
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "chat_template": open(TEMPLATE).read(),
        "clean_up_tokenization_spaces": True,
        "eos_token": EOT,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
