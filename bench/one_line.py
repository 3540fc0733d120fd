#!/usr/bin/env python
"""A whole transformers model in one line: the step time of `remat.checkpoint_model`
against `checkpoint_layers` on the same layers, transformers' own checkpointing
(torch.utils.checkpoint) and no checkpointing, in interleaved rounds of one run.

    python bench/one_line.py            # tiny Llama, GPT-2, BERT, Mistral, T5; 7 rounds x 20 steps, one thread
    python bench/one_line.py --quick    # 2 rounds x 2 steps (what the test runs)

Each step is forward + backward of the causal-LM loss, batch 2, sequence 16, float32,
dropout on; min and median of the rounds' per-step means. The ratio row divides
checkpoint_model's time by checkpoint_layers' (goal: at most 1.2). checkpoint_layers runs
with the model's `use_cache=False` (its layers would otherwise fill the key/value cache,
which makes them replay); checkpoint_model turns the cache off itself, as transformers'
own checkpointing does.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import remat
from remat import policies as P

VOCAB, SEQ, BATCH = 100, 16, 2


def _models() -> dict[str, Callable[[], torch.nn.Module]]:
    import transformers as T

    def llama() -> torch.nn.Module:
        config = T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1)
        return T.LlamaForCausalLM(config)

    def gpt2() -> torch.nn.Module:
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=2 * SEQ))

    def bert() -> torch.nn.Module:
        config = T.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                              intermediate_size=128, max_position_embeddings=2 * SEQ)
        return T.BertForMaskedLM(config)

    def mistral() -> torch.nn.Module:
        config = T.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, sliding_window=SEQ // 2, attention_dropout=0.1)
        return T.MistralForCausalLM(config)

    def t5() -> torch.nn.Module:
        config = T.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                            num_heads=4, decoder_start_token_id=0, pad_token_id=0)
        return T.T5ForConditionalGeneration(config)

    return {"llama": llama, "gpt2": gpt2, "bert": bert, "mistral": mistral, "t5": t5}


STACKS: dict[str, Callable[[Any], list[Any]]] = {  # the layer stacks checkpoint_layers is given
    "llama": lambda m: [m.model.layers],
    "gpt2": lambda m: [m.transformer.h],
    "bert": lambda m: [m.bert.encoder.layer],
    "mistral": lambda m: [m.model.layers],
    "t5": lambda m: [m.encoder.block, m.decoder.block],
}


def _variants(build: Callable[[], torch.nn.Module], stacks: Callable[[Any], list[Any]]) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    plain = build().train()
    one_line, stack, own = (copy.deepcopy(plain) for _ in range(3))
    remat.checkpoint_model(one_line, P.dots_saveable)
    for module in stack.modules():  # else its layers fill a cache, which replays (checkpoint_model turns it off)
        if getattr(module, "config", None) is not None:
            module.config.use_cache = False  # T5's stacks hold configs of their own
    for layers in stacks(stack):
        remat.checkpoint_layers(layers, P.dots_saveable)
    own.activation_checkpointing_enable()
    return {"checkpoint_model": one_line, "checkpoint_layers": stack, "transformers' own": own, "plain": plain}


def measure(rounds: int, steps: int) -> dict[str, dict[str, dict[str, float]]]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, build in _models().items():
        models = _variants(build, STACKS[name])

        def step(model: torch.nn.Module) -> None:
            model(input_ids=ids, labels=ids).loss.backward()

        for model in models.values():
            for _ in range(3):  # traced and warm
                step(model)
        times: dict[str, list[float]] = {k: [] for k in models}
        order = list(models)
        for r in range(rounds):
            for k in order[r % len(order):] + order[: r % len(order)]:
                start = time.perf_counter()
                for _ in range(steps):
                    step(models[k])
                times[k].append((time.perf_counter() - start) / steps * 1e3)
        results[name] = {k: {"min": min(v), "median": statistics.median(v)} for k, v in times.items()}
        results[name]["ratio"] = {
            stat: results[name]["checkpoint_model"][stat] / results[name]["checkpoint_layers"][stat]
            for stat in ("min", "median")
        }
    return results


def render(results: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = ["| model | step (ratio: no unit) | min ms | median ms |", "|---|---|---:|---:|"]
    for name, rows in results.items():
        for variant, row in rows.items():
            label = "ratio: checkpoint_model / checkpoint_layers" if variant == "ratio" else variant
            lines.append(f"| {name} | {label} | {row['min']:.2f} | {row['median']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds, steps = (2, 2) if args.quick else (7, 20)
    results = measure(rounds, steps)
    print(f"torch {torch.__version__}, 1 thread, {rounds} rounds x {steps} steps")
    print(render(results))


if __name__ == "__main__":
    main()
