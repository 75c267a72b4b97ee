"""Quick demo on tiny random models: TETRIS vs fixed-k batched speculative decoding vs plain generate.

    python examples/quick_demo.py

Random models agree by chance only, so this shows the API and the bookkeeping, not a speed-up: `tetris-hf bench`
measures real models.
"""

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")


def main():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1)
    target = LlamaForCausalLM(config).eval()
    draft = copy.deepcopy(target)  # a draft that agrees often: the target plus noise
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(0.3 * parameter.std() * torch.randn_like(parameter))

    input_ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7], [0, 0, 0, 9, 10], [0, 11, 12, 13, 14]])
    attention_mask = (input_ids != 0).long()
    plain = target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=24, do_sample=False)
    print(f"{'strategy':<10} {'steps':>5} {'verified':>8} {'accepted':>8} {'VSR':>5}  same as plain generate")
    for strategy in ("fixed", "tetris"):
        out = target.generate(input_ids, attention_mask=attention_mask, assistant_model=draft,
                              custom_generate="tetris", tetris_strategy=strategy, num_assistant_tokens=3,
                              tetris_extra_tokens=2, max_new_tokens=24, do_sample=False,
                              return_dict_in_generate=True)
        stats = out.tetris_stats
        print(f"{strategy:<10} {stats.steps:>5} {stats.verified_tokens:>8} {stats.accepted_tokens:>8} "
              f"{stats.verification_success_rate:>5.2f}  {torch.equal(out.sequences, plain)}")


if __name__ == "__main__":
    main()
