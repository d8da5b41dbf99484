"""Load an exported Hugging Face folder with plain `transformers` and generate from a prompt.

    python examples/generate_hf.py runs/llama_tiny/hf "def "
"""

import sys

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM


def main(folder: str, prompt: str = "def ", num_tokens: int = 40) -> str:
    model = AutoModelForCausalLM.from_pretrained(folder)  # the folder meshtrain exported
    tokenizer = Tokenizer.from_file(f"{folder}/tokenizer.json")
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=num_tokens, do_sample=True, top_k=20,
                         temperature=0.8, pad_token_id=0)
    return tokenizer.decode(out[0].tolist())


if __name__ == "__main__":
    print(f"--- transformers.AutoModelForCausalLM.from_pretrained({sys.argv[1]!r}).generate ---")
    print(main(*sys.argv[1:2], *sys.argv[2:3]))
