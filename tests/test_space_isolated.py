"""The Space folder stands alone: the Space as ``tetris-hf export-space DIR`` writes it (examples/space/'s files and
the Hub folder as its strategy/, not kept in git) imports, builds its page and runs its four runs, with a
draft model (chains and trees), an EAGLE head (chains and trees) and with prompt lookup, in a Python that cannot import
tetris_hf (tests/isolated_python.py), with the
strategy from its own strategy/ folder (so prompt lookup needs an export that has it) and the models loaded by its
own space_models.py. Its shared request stream runs there too: two visitors' requests in one batch, from the
strategy copy's request stream (an export that has tetris_hf.continuous)."""

from __future__ import annotations

from pathlib import Path

import pytest

from isolated_python import run_isolated
from tetris_hf.tools.hub_export import export_space
from tiny_models import noisy_copy, sharpen, tiny_llama
from tiny_tokenizer import tiny_tokenizer


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> Path:
    """The exported Space, once for the module (both tests only read it)."""
    folder = tmp_path_factory.mktemp("space") / "space-copy"
    export_space(folder)
    return folder


SCRIPT = '''
import sys
import threading
sys.path.insert(0, SPACE)
import gradio as gr
import app
import space_models
import tetris_runs
from transformers import AutoModelForCausalLM

target, draft, tokenizer, description = space_models.load_pair("target", "early-exit:1", "cpu")
trained, trained_description = space_models.load_draft(target, "tetris-draft")
model_draft, _ = space_models.load_draft(target, "model-draft")
demo = app.build_app(target, draft, tokenizer, description=description + "  \\n**Device:** "
                     + app.device_description("cpu"))
runs = {strategy: tetris_runs.LiveRun(strategy) for strategy in tetris_runs.STRATEGIES}
tetris_runs.run_all(target, trained, tokenizer, ["the quick brown fox", "hello how are you today ?"],
                    tetris_runs.Settings(k=2, extra=1, max_new_tokens=6), runs, threading.Event())
eagle, eagle_description = space_models.load_draft(target, "eagle:" + EAGLE)
eagle_runs = {strategy: tetris_runs.LiveRun(strategy) for strategy in tetris_runs.STRATEGIES}
tetris_runs.run_all(target, eagle, tokenizer, ["the quick brown fox", "hello how are you today ?"],
                    tetris_runs.Settings(k=2, extra=1, max_new_tokens=6), eagle_runs, threading.Event())
tree_runs = {strategy: tetris_runs.LiveRun(strategy) for strategy in tetris_runs.STRATEGIES}
tetris_runs.run_all(target, trained, tokenizer, ["the quick brown fox", "hello how are you today ?"],
                    tetris_runs.Settings(k=2, extra=1, max_new_tokens=6, tree_width=2), tree_runs, threading.Event())
import tetris_board
tree_board = tree_runs[tetris_runs.TETRIS].board(2)
tree_page = tetris_board.render_board(tree_board, 1, lambda ids: [tokenizer.decode([i]) for i in ids])
first_trees = [tree for tree in tree_board.trees(0) if tree is not None]
eagle_tree = tetris_runs.LiveRun(tetris_runs.TETRIS)
tetris_runs.run_speculative(target, eagle, tokenizer,
                            tetris_runs.encode_prompts(tokenizer, ["the quick brown fox", "hello how are you today ?"],
                                                       "cpu"),
                            tetris_runs.Settings(k=2, extra=1, max_new_tokens=6, tree_width=2), tetris_runs.TETRIS,
                            eagle_tree, threading.Event())
lookup = {strategy: tetris_runs.LiveRun(strategy) for strategy in tetris_runs.STRATEGIES}
tetris_runs.run_all(target, None, tokenizer, ["the quick brown fox the quick brown", "hello how are you today ?"],
                    tetris_runs.Settings(draft=tetris_runs.LOOKUP, k=2, extra=1, max_new_tokens=8), lookup,
                    threading.Event())
report({
    "blocks": isinstance(demo, gr.Blocks),
    "handlers": sorted(fn.fn.__name__ for fn in demo.fns.values()),
    "description": description,
    "trained": trained_description,
    "shares_head": trained.lm_head is target.lm_head and draft.model.embed_tokens is target.model.embed_tokens,
    "model_draft_layers": model_draft.config.num_hidden_layers,
    "states": [runs[s].state for s in tetris_runs.STRATEGIES],
    "messages": [runs[s].message for s in tetris_runs.STRATEGIES],
    "differing": tetris_runs.greedy_agreement(runs),
    "eagle_description": eagle_description,
    "eagle_choices": app.draft_choices(eagle),
    "eagle_states": [eagle_runs[s].state for s in tetris_runs.STRATEGIES],
    "eagle_messages": [eagle_runs[s].message for s in tetris_runs.STRATEGIES],
    "eagle_differing": tetris_runs.greedy_agreement(eagle_runs),
    "eagle_drafted": [eagle_runs[s].stats.drafted_tokens if eagle_runs[s].stats else 0
                      for s in tetris_runs.SPECULATIVE],
    "tree_states": [tree_runs[s].state for s in tetris_runs.STRATEGIES],
    "tree_messages": [tree_runs[s].message for s in tetris_runs.STRATEGIES],
    "tree_differing": tetris_runs.greedy_agreement(tree_runs),
    "tree_nodes": [sum(len(tree.tokens) for tree in first_trees), tree_page.count('<g class="tree-node')],
    "tree_path": [sum(len(tree.path) for tree in first_trees), tree_page.count('class="tree-edge on-path"'),
                  sum(a for a in tree_board.accepted_per_step[0] if a > 0)],
    "eagle_tree_equal": eagle_tree.rows == eagle_runs[tetris_runs.PLAIN].rows,
    "eagle_tree_steps": sum(step is not None for step in eagle_tree.trees),
    "lookup_states": [lookup[s].state for s in tetris_runs.STRATEGIES],
    "lookup_messages": [lookup[s].message for s in tetris_runs.STRATEGIES],
    "lookup_differing": tetris_runs.greedy_agreement(lookup),
    "lookup_drafted": [lookup[s].stats.drafted_tokens if lookup[s].stats else 0 for s in tetris_runs.SPECULATIVE],
    "strategy_source": tetris_runs.STRATEGY_SOURCE,
    "tetris_hf_loaded": sorted(name for name in sys.modules if name.split(".")[0] == "tetris_hf"),
})
'''


def _save_eagle_head(target, folder: Path) -> None:
    """A random EAGLE-3 head for the 2-layer target, in the published format (written by tetris_hf, in this process)."""
    import torch

    from tetris_hf.candidate_generators.eagle import EagleDraft

    torch.manual_seed(9)
    EagleDraft.for_target(target, aux_layer_ids=(0, 1, 1)).save_pretrained(folder)


def _save_tetris_draft(target, folder: Path) -> None:
    """A 1-layer draft in the tetris-hf draft format (its own layers and norm; embedding and head are the target's)."""
    import json

    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    torch.manual_seed(5)
    own = {f"model.layers.0.{name}": tensor + 0.01 * torch.randn_like(tensor)
           for name, tensor in target.model.layers[0].state_dict().items()}
    own["model.norm.weight"] = target.model.norm.weight.detach().clone()
    save_file({name: tensor.contiguous() for name, tensor in own.items()}, str(folder / "draft.safetensors"))
    config = {"format": "tetris-hf-draft", "version": 1, "num_layers": 1,
              "target": {key: getattr(target.config, key) for key in
                         ("model_type", "hidden_size", "vocab_size", "num_hidden_layers")},
              "shared_with_target": ["lm_head.weight", "model.embed_tokens.weight"], "metadata": {}}
    (folder / "draft_config.json").write_text(json.dumps(config))


def test_space_copy_builds_its_page_and_runs_without_tetris_hf(space, tmp_path):
    pytest.importorskip("gradio", reason="the Space's page needs gradio (examples/space/requirements.txt)")
    target = sharpen(tiny_llama(vocab_size=64, seed=0), 6.0)
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    noisy_copy(target, 0.15).save_pretrained(tmp_path / "model-draft")
    _save_tetris_draft(target, tmp_path / "tetris-draft")

    _save_eagle_head(target, tmp_path / "eagle-head")

    result = run_isolated(f"SPACE = {str(space)!r}\nEAGLE = {str(tmp_path / 'eagle-head')!r}\n" + SCRIPT, tmp_path)

    assert result["tetris_hf_loaded"] == []
    assert result["blocks"] and {"on_run", "on_stop", "on_preset"} <= set(result["handlers"])
    assert result["strategy_source"] == str(space / "strategy")
    # the models in words, no local paths (the page is public)
    assert "**Target:** target, 2 layers, fp32" in result["description"]
    assert "the target's own first 1 of 2 layers and its head, untrained" in result["description"]
    assert result["trained"].startswith("a 1-layer draft trained for this target") and result["shares_head"]
    assert result["trained"].endswith("(tetris-draft)")
    assert not any(str(tmp_path) in result[key] for key in ("description", "trained", "eagle_description"))
    assert result["model_draft_layers"] == 2
    assert result["states"] == ["done"] * 4, result["messages"]
    assert result["differing"] == []
    # an EAGLE head, loaded by the strategy copy's EagleDraft and recognised by the strategy transformers loads
    assert "EAGLE-3 head" in result["eagle_description"] and result["eagle_choices"][0][0].startswith("EAGLE head")
    assert result["eagle_states"] == ["done"] * 4, result["eagle_messages"]
    assert result["eagle_differing"] == [] and min(result["eagle_drafted"][:2]) > 0
    # draft trees (tetris_tree_width=2), captured by the Space from the strategy copy's loop, drawn node by node
    assert result["tree_states"] == ["done"] * 4, result["tree_messages"]
    assert result["tree_differing"] == []
    nodes, drawn = result["tree_nodes"]
    assert nodes > 0 and drawn == nodes
    on_path, drawn_path, accepted = result["tree_path"]
    assert on_path == drawn_path == accepted
    assert result["eagle_tree_equal"] and result["eagle_tree_steps"] > 0  # an EAGLE head grows trees too
    # prompt lookup: no draft model, drafts copied from the prompt (needs a strategy/ export that has prompt lookup)
    assert result["lookup_states"] == ["done"] * 4, result["lookup_messages"]
    # fixed and TETRIS always draft; adaptive may draft nothing when its timings say drafting does not pay
    fixed_drafted, tetris_drafted, _ = result["lookup_drafted"]
    assert result["lookup_differing"] == [] and fixed_drafted > 0 and tetris_drafted > 0


STREAM_SCRIPT = '''
import sys
import threading
sys.path.insert(0, SPACE)
import torch
import shared_stream
import space_models
import tetris_runs

target, draft, tokenizer, _ = space_models.load_pair("target", "model-draft", "cpu")
stream = shared_stream.shared_stream(target, draft)
prompts = ["the quick brown fox", "hello how are you today ?"]
ids = [tetris_runs.encode_prompts(tokenizer, [text], "cpu")["input_ids"][0].tolist() for text in prompts]
ready = threading.Barrier(2)
last = {}

def visit(index):
    ready.wait()
    *_, last[index] = stream.submit(ids[index], 64, f"visitor {index + 1}", prompts[index])

threads = [threading.Thread(target=visit, args=(index,)) for index in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
alone = []
for prompt in ids:
    prompt = torch.tensor([prompt])
    out = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64, do_sample=False)
    alone.append(out[0, prompt.shape[1]:].tolist())
board = stream.board()
report({
    "states": [last[index].state for index in range(2)],
    "equal_alone": [last[index].tokens == alone[index] for index in range(2)],
    "most_rows": [last[index].most_rows for index in range(2)],
    "board_most_rows": board.most_rows,
    "manager_module": type(stream.manager).__module__,
    "tetris_hf_loaded": sorted(name for name in sys.modules if name.split(".")[0] == "tetris_hf"),
})
stream.stop()
'''


def test_space_copy_serves_two_visitors_in_one_batch_without_tetris_hf(space, tmp_path):
    target = sharpen(tiny_llama(vocab_size=64, seed=0), 6.0)
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    noisy_copy(target, 0.15).save_pretrained(tmp_path / "model-draft")

    result = run_isolated(f"SPACE = {str(space)!r}\n" + STREAM_SCRIPT, tmp_path)

    assert result["tetris_hf_loaded"] == []
    assert result["manager_module"] == "space_strategy.continuous"  # the strategy copy's request stream
    assert result["states"] == ["done", "done"]
    assert result["equal_alone"] == [True, True]  # greedy: each visitor's output is the target's alone
    assert result["most_rows"] == [2, 2] and result["board_most_rows"] == 2  # both in the same batch
