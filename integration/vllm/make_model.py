"""Builds the tiny random-weight Llama that the real-vLLM tests serve.

Nothing comes from a hub: the weights are seeded random numbers and the
tokenizer is a byte-level BPE trained on a frozen copy of the repository's
own docs (tokenizer-corpus.json.gz: README.md and docs/*.md as of commit
7f1238f, one string per file), so the same checkout always builds the same
model, and editing the docs never changes it (docs/vllm.md). A new page
under docs/ once changed the tokenizer, and with it how many tokens the
real-vLLM tests' prompts take.

    python make_model.py --out DIR     build into DIR (replaced atomically)
    python make_model.py --list-inputs print the files the model depends on
"""

import argparse
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEED = 20261201
VOCAB_SIZE = 2048
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML. Content arrives as a string or as OpenAI content parts; an
# assistant's tool calls and the tools offered are rendered as JSON so that
# every turn of an agent's session lengthens the prompt.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif -%}"
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['text'] is defined %}{{ part['text'] }}{% endif %}{% endfor %}{% endif -%}"
    "{%- if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}{% endif -%}"
    "<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)


CORPUS = Path(__file__).resolve().parent / "tokenizer-corpus.json.gz"


def training_files():
    """The files the model depends on (besides this script)."""
    return [CORPUS]


def training_texts():
    """The tokenizer's training text: one string per file, in a fixed order."""
    import gzip
    import json

    with gzip.open(CORPUS, "rt", encoding="utf-8") as corpus:
        return json.load(corpus)


def build(out: Path):
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = training_texts()
    tok.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        # Head size 32: the CPU attention backend accepts 32, 64, 80, ...
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=16384,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id

    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"kvmesh tiny llama: {params} parameters, vocabulary {len(tokenizer)}, in {out}", file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--list-inputs", action="store_true")
    args = parser.parse_args()
    if args.list_inputs:
        for path in training_files():
            print(path)
        return
    if args.out is None:
        parser.error("--out DIR is required")
    build(args.out.resolve())


if __name__ == "__main__":
    main()
