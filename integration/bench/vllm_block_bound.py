"""The infinite-cache hit rate of a text trace as a vLLM engine can reach it.

One cache that never evicts, in vLLM's full 128-token blocks: each call is
rendered as one user message through the tiny model's ChatML template and
tokenized with its tokenizer; a call's hit is its run of leading blocks that
some earlier call (in arrival order) also had. `simulate`'s bound counts in
its own token estimate and 16-token blocks, so it is higher.

    .tools/vllm/bin/python integration/bench/vllm_block_bound.py TRACE.jsonl...
"""

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

BLOCK = 128
MODEL = Path(__file__).resolve().parents[2] / ".tools" / "vllm-model" / "tokenizer.json"


def main() -> None:
    tok = Tokenizer.from_file(str(MODEL))
    for path in sys.argv[1:]:
        calls = sorted((json.loads(line) for line in open(path)), key=lambda c: c["timestamp"])
        seen, total, hit, distinct = set(), 0, 0, 0
        for call in calls:
            text = "<|im_start|>user\n" + call["input"] + "<|im_end|>\n<|im_start|>assistant\n"
            ids = tok.encode(text).ids
            total += len(ids)
            chain, leading, blocks = (), True, []
            for i in range(len(ids) // BLOCK):
                chain = hash((chain, tuple(ids[i * BLOCK : (i + 1) * BLOCK])))
                if leading and chain in seen:
                    hit += BLOCK
                else:
                    leading = False
                blocks.append(chain)
            seen.update(blocks)
        distinct = len(seen)
        print(
            f"{path}: {len(calls)} calls, {total} prompt tokens, {distinct} distinct full blocks "
            f"({distinct * BLOCK} tokens), block-granular infinite-cache hit rate {hit / max(total, 1):.4f}"
        )


if __name__ == "__main__":
    main()
