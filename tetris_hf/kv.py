"""A model's KV cache for a batch whose rows advance by different amounts each step: :class:`SlotCache`.

Buffers allocated once, written at one shared pointer; per slot, whether it holds a real token and that token's
position, from which every forward's attention mask is built (:mod:`tetris_hf.attention`), so holes (rejected drafts,
filler) and moved slots change nothing the model computes. Design and invariants: docs/design.md, "The slot cache".
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import AttentionLayout, check_tree_layout, position_masks, real_prefix_mask
from .cross_attention import CrossAttention
from .packing import BlockSplit, Packing
from .routing import is_routed, routed_attention
from .slot_attention import SlotArguments, describe
from .static_shapes import batch_bucket, standard_strides, static_capacity


def slots_needed(layout: AttentionLayout, prompt_length: int, max_length: int, block: int, max_holes: int) -> int:
    """Slots per row a cache needs for a whole call: every token up to ``max_length`` plus a block and the holes
    allowed; on a model whose every layer has a window, the prompt or the window (what outlives it is dropped), plus
    the same margins, however long the call."""
    margin = 2 * block + max_holes  # the block being written, the one not yet repacked, and the holes allowed
    if layout.reach is None:
        return max_length + margin
    return min(max_length, max(prompt_length, layout.reach)) + margin


def takes_attention_arguments(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward takes arbitrary keyword arguments (which transformers hands down to its attention
    layers)."""
    return _takes_keywords(type(model))


@functools.cache
def _takes_keywords(model_class: type) -> bool:
    parameters = inspect.signature(model_class.forward).parameters.values()
    return any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters)


def select_features(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """``(B, T, F)`` the hidden states at ``layers`` (``hs[i]``, ``i < L`` the input of decoder layer ``i``, ``hs[L]``
    the final norm's output), concatenated in that order."""
    parts = [hidden_states[index] for index in layers]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values, ``(B, H, capacity, D)`` allocated at its first write, written at the cache's
    shared pointer (a split block's new rows from their own first slots:
    :attr:`~tetris_hf.packing.Packing.later_slot`); :meth:`update` returns the written prefix ``[:, :, :pointer + L]``
    (a view), or in a static-shape forward (:attr:`SlotCache.write_index` set) the whole capacity of the padded batch.
    ``keys`` / ``values`` are the active rows, the first rows of the buffers (a static cache's, ``static_keys`` /
    ``static_values``, stay put)."""

    is_sliding = False

    def __init__(self, owner: "SlotCache"):
        super().__init__()
        self.owner = owner  # a weak proxy (see SlotCache): no reference cycle keeps the buffers after the call
        self.static_keys: torch.Tensor | None = None
        self.static_values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads = key_states.shape[:2]
        owner = self.owner
        if owner.packing is not None:  # a packed first forward: (1, H, N, D) for the block's rows
            batch = owner.packing.batch_size
        # room for every row the cache may hold: the padded batches of a static cache's later steps, the rows a
        # stream adds (SlotCache.add_rows)
        rows = max(owner.batch_size, owner.max_rows, batch)
        keys = key_states.new_zeros(rows, heads, owner.capacity, key_states.shape[-1])
        values = value_states.new_zeros(rows, heads, owner.capacity, value_states.shape[-1])
        self.buffer_keys, self.buffer_values = keys, values
        self.keys, self.values = keys[:batch], values[:batch]
        if owner.static:
            self._keep_static(keys, values)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _keep_static(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Compiled steps (CUDA graphs) need buffers that stay put; their sizes are constants of the graphs (under
        dynamic shapes too, where the batch would otherwise be tied to the buffers' rows while they are equal)."""
        for buffer in (keys, values):
            torch._dynamo.mark_static_address(buffer)
            torch._dynamo.mark_static(buffer)
        self.static_keys, self.static_values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        if owner.packing is not None:  # a packed forward: (1, H, N, D), each token into its row at its slot
            packing, start = owner.packing, owner.pointer
            packing.write(self.keys, self.values, key_states, value_states, start)
            end = packing.slots_end(start)
            return self.keys[:, :, :end], self.values[:, :, :end]
        if owner.write_index is not None:  # a static-shape step: the padded batch, every slot
            rows = key_states.shape[0]
            keys, values = self.static_keys[:rows], self.static_values[:rows]
            index = owner.write_index.to(keys.device)
            keys.index_copy_(2, index, key_states)
            values.index_copy_(2, index, value_states)
            return keys, values
        start = owner.pointer
        end = start + key_states.shape[-2]
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.pointer + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.pointer

    def get_max_length(self) -> int:
        return self.owner.capacity

    def rebuild(self, transform) -> None:
        """Replace the buffers by ``transform(tensor)`` (growth); keys and values stay views of their first rows."""
        if not self.is_initialized:
            return
        rows = self.keys.shape[0]
        self.buffer_keys, self.buffer_values = transform(self.buffer_keys), transform(self.buffer_values)
        if self.static_keys is not None:
            self._keep_static(self.buffer_keys, self.buffer_values)
        self.keys, self.values = self.buffer_keys[:rows], self.buffer_values[:rows]

    def add_rows(self, num_rows: int) -> None:
        """The first ``num_rows`` rows of the buffers become the active ones (rows after the current ones join,
        holding whatever an earlier row left there, which their masks hide); the buffers grow if they hold fewer."""
        if not self.is_initialized:
            return
        if num_rows > self.buffer_keys.shape[0]:
            extra = num_rows - self.buffer_keys.shape[0]
            self.rebuild(lambda tensor: torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])]))
        self.keys, self.values = self.buffer_keys[:num_rows], self.buffer_values[:num_rows]

    def repack(self, order: torch.Tensor, flat_index: dict, moves: tuple[torch.Tensor, ...] | None = None) -> None:
        """Slot ``order[i, j]`` of row ``i`` moves to slot ``j`` (``order``: ``(B, width)``), in place. ``moves``:
        ``(rows, targets, sources)`` ``(M,)`` each, the slots that hold a real token after the repack and came from
        elsewhere, where the caller listed them: only those are copied (a stream's repack after a long prompt joins
        moves one row's slots, where the whole cache is ``B x width``); else every slot of ``[0, width)``, one
        ``index_select`` of whole slots from a ``(B * H * capacity, D)`` view. ``flat_index`` caches those slot
        numbers by shape and device across layers."""
        batch, heads, capacity, head_dim = self.keys.shape
        width = order.shape[1]
        key = (batch, heads, capacity, self.keys.device, moves is not None)
        if key not in flat_index:
            first_slot = torch.arange(heads, device=self.keys.device) * capacity
            if moves is None:
                order = order.to(self.keys.device)
                first_slot = (torch.arange(batch, device=order.device) * heads * capacity).view(batch, 1, 1) + \
                    first_slot.view(1, heads, 1)
                flat_index[key] = (first_slot + order[:, None, :]).flatten()  # (B * H * width,)
            else:  # (M * H,) slots each, target and source
                rows, targets, sources = (tensor.to(self.keys.device) for tensor in moves)
                row_slot = (rows * heads * capacity)[:, None] + first_slot
                flat_index[key] = ((row_slot + targets[:, None]).flatten(), (row_slot + sources[:, None]).flatten())
        for tensor in (self.keys, self.values):
            if moves is None:
                moved = tensor.reshape(-1, head_dim).index_select(0, flat_index[key])
                tensor[:, :, :width] = moved.view(batch, heads, width, head_dim)
            else:  # (the sources read before any target is written: moves that overlap are safe)
                targets, sources = flat_index[key]
                flat = tensor.view(-1, head_dim)
                flat.index_copy_(0, targets, flat.index_select(0, sources))

    def fill_rows(self, targets: torch.Tensor, sources: torch.Tensor, num_rows: int, written: int) -> None:
        """Row ``sources[i]`` overwrites row ``targets[i]`` (its first ``written`` slots), then the first ``num_rows``
        rows remain (a view of the same buffers: nothing is reallocated)."""
        targets, sources = targets.to(self.keys.device), sources.to(self.keys.device)
        for name in ("keys", "values"):
            tensor = getattr(self, name)
            filled = tensor[:, :, :written]
            filled.index_copy_(0, targets, filled.index_select(0, sources))
            setattr(self, name, tensor[:num_rows])


def rows_after_fill(targets: torch.Tensor, sources: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``(num_rows,)`` each remaining row's former index after a ``fill_rows(targets, sources, num_rows)`` (of a
    :class:`SlotCache` or a drafter): row ``sources[i]`` takes the place of row ``targets[i]``."""
    return torch.arange(num_rows, device=targets.device).index_copy(0, targets, sources)


def _later_rows_last(first: torch.Tensor, later: torch.Tensor) -> torch.Tensor:
    """A split block's logits: ``first`` ``(R, W, V)`` the first rows', then ``later`` ``(M, V)`` each later row's
    last token's, in column 0 of rows of their own: ``(R + M, W, V)``."""
    rows = later.new_zeros(later.shape[0], *first.shape[1:])
    rows[:, 0] = later
    return torch.cat([first, rows])


class SlotCache:
    """Preallocated KV buffers + per-slot ``slot_mask`` (True = real token) and ``slot_positions`` for one model.

    Args:
        batch_size: rows at the start.
        device: where the masks live (the model's input device).
        max_holes: repack once the cache is longer than its longest row's real tokens by more than this.
        capacity: slots to allocate per row (the buffers grow, by reallocation, if a forward would overflow them
            even after repacking; a static cache then compiles or records new graphs for the new width, which
            :func:`slots_needed` sizes the cache never to need).
    """

    def __init__(self, batch_size: int, device: torch.device, max_holes: int = 32, capacity: int = 256):
        # What the layers read comes first (a deep copy of the layers copies what was set before the cache).
        self.max_holes = max_holes
        self.batch_size = batch_size
        self.max_rows = batch_size  # rows the buffers are allocated for (a stream raises it before the first forward)
        self.capacity = max(int(capacity), 1)
        self.pointer = 0  # slots written per row, holes included (host-side: no device read needed)
        self.block_start = 0  # the slot the last forward's block was written from (its first rows')
        self.dense = True  # every written slot of every row is real (host-side)
        self.new_from = None  # rows from this one on joined since the last forward: nothing real in them yet
        self.static = False  # see step_forward
        self.write_index: torch.Tensor | None = None  # (L,) the slots a static-shape forward writes, during it
        self.pack = False  # read blocks with filler packed (see packs); set by whoever checked the model can be
        self.packing: Packing | None = None  # where a packed forward's tokens go, during it
        self.tokens_read = 0  # tokens the model's last forward read (packed: the real ones only)
        owner = weakref.proxy(self)  # layers that pointed back at the cache strongly would form a reference cycle,
        self.cache = Cache(layer_class_to_replicate=lambda: SlotLayer(owner))  # freed only by the cyclic GC
        self._allocate_masks(device)
        self.next_positions = torch.zeros(batch_size, dtype=torch.long, device=device)  # real tokens cached so far
        self.causal: torch.Tensor | None = None  # see _causal
        self.layout: AttentionLayout | None = None
        self._step_forward = None
        self.eager_shapes_forward = None  # see _compiled_packing
        self.longest_bound = 0  # an upper bound on any row's real slots (tightened by compact(longest))
        self.cross: CrossAttention | None = None  # an encoder-decoder's (see _know): moves rows, never rolled back
        self.first_rows = torch.arange(batch_size, device=device)  # each row's index in the first batch (its memory)

    def _allocate_masks(self, device: torch.device) -> None:
        self.slot_mask = torch.zeros(self.batch_size, self.capacity, dtype=torch.bool, device=device)
        self.slot_positions = torch.zeros(self.batch_size, self.capacity, dtype=torch.long, device=device)
        self.offsets = torch.arange(self.capacity, device=device)

    @property
    def step_forward(self):
        """A compiled forward for the step forwards (:mod:`tetris_hf.compiled`), else ``None`` (the model). Setting
        one, before the first forward, makes the cache static (:attr:`static`): fixed capacity, static shapes."""
        return self._step_forward

    @step_forward.setter
    def step_forward(self, forward) -> None:
        if forward is not None and not self.static:
            if self.cache.layers or self.pointer:
                raise RuntimeError("SlotCache.step_forward must be set before the cache's first forward")
            self.capacity = static_capacity(self.capacity)
            self._allocate_masks(self.slot_mask.device)
            self.static = True
        self._step_forward = forward

    @property
    def length(self) -> int:
        """Slots per row in use, holes included."""
        return self.pointer

    def forward(self, model: torch.nn.Module, input_ids: torch.Tensor, input_mask: torch.Tensor | None,
                logits_to_keep: int = 0, step: bool = False, real_lengths: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, visibility: torch.Tensor | None = None,
                num_real: int | None = None, discard_logits: bool = False, first_row: int = 0,
                split: BlockSplit | None = None, hidden_states: tuple[int, ...] | None = None,
                prompt_lengths: tuple[int, ...] = (), row_inputs: dict[str, torch.Tensor] | None = None):
        """Run ``model`` (a causal LM taking ``attention_mask``, ``position_ids``, ``past_key_values``) on a block
        ``input_ids`` ``(B, L)`` appended to every row, and cache it. A real token's position is the number of real
        tokens before it in its row; filler takes a neighbour's, which nothing sees.

        Which tokens are real: ``input_mask`` ``(B, L)`` (1 real, 0 filler); ``None`` when all are, or when
        ``real_lengths`` ``(B,)`` says row ``i``'s first ``real_lengths[i]`` are (a verified block). ``num_real``:
        their sum, a host int, with ``real_lengths`` or a left-padded ``input_mask``: the block is then read packed
        where the model can be (:attr:`packs`; filler's logits are zeros).

        Other arguments: ``logits_to_keep`` the last this-many positions' logits only (0: all; packed, 1 keeps each
        row's last real token's); ``step`` a decoding step's forward (through :attr:`step_forward` when set);
        ``position_ids`` ``(B, L)`` in place of counting on (a tree's nodes; ``next_positions`` then advances as a
        bound until :meth:`keep_slots`); ``visibility`` ``(B, L, W)``, ``W >= L``, which of the last ``W`` slots each
        token sees, in place of causality (a tree's ancestors); ``discard_logits``: only the cache is wanted;
        ``first_row``: no row before it has a real token; ``split``: with ``real_lengths`` and ``num_real``, on a cache
        that packs, the decoding rows and the joining prompts after them attended apart, logits ``(B, split.width,
        V)`` for the first rows' tokens and each later row's last token (later rows that joined since the last forward,
        on a plain sdpa layout, written from their own first slots: :meth:`_later_slot`); ``hidden_states``: indices
        of the model's hidden states to return too (transformers' numbering, :func:`select_features`);
        ``prompt_lengths``: with ``real_lengths``, the same for the last ``len(prompt_lengths)`` rows as host ints,
        where those rows read prompts (a packed read then attends to them row by row:
        :class:`~tetris_hf.packing.Packing`); ``row_inputs``: more inputs of the model's forward, one ``(B, L, F)``
        tensor per keyword argument, a value per block token (an EAGLE head's ``target_features`` or
        ``draft_features``), read as the block is (packed with it, padded with zeros for a static step's dummy rows).

        Returns:
            ``(B, L or logits_to_keep, V)`` logits, or ``None`` with ``discard_logits``; with ``hidden_states``,
            ``(logits, features)``: ``features`` ``(B, L, F)`` the selected states concatenated (zeros at filler of
            a packed read; ``None`` for no index).
        """
        self._know(model)
        block = input_ids.shape[1]
        self._check_block(model, block, visibility, split, logits_to_keep)
        later_slot, later = self._later_slot(split, input_mask, real_lengths, num_real, visibility), None
        if later_slot is None:
            self._make_room(block)
            start, end = self.pointer, self.pointer + block
        else:  # (the later rows' own first slots: the block widens the others by the first rows' width only)
            self._make_room(split.width, reach=later_slot + block)
            start = self.pointer
            end = max(start + split.width, later_slot + block)
            later = (split.rows, later_slot, split.width)
        position_ids, new_tokens = self._mark_slots(start, block, end, input_mask, real_lengths, position_ids, later)
        next_positions = self.next_positions + new_tokens  # (before the forward: right after it, caches are cold)
        extra = {"output_hidden_states": list(hidden_states)} if hidden_states else {}
        row_inputs = row_inputs or {}
        all_real = input_mask is None and real_lengths is None or num_real == input_ids.numel()
        # static shapes: a compiled step on prepared masks, once the first (eager) forward allocated the buffers
        if step and self.static and self.layout.prepared and self.cache.layers and visibility is None:
            logits, features = self._static_forward(model, input_ids, position_ids, start, end, logits_to_keep, extra,
                                                    row_inputs)
        else:
            # (a static cache's steps keep their shapes; its other reads, a joining prompt's, read packed)
            packing = None if step and self.static else self._packing(input_mask, real_lengths, num_real, block,
                                                                      logits_to_keep, first_row, split,
                                                                      prompt_lengths, later_slot)
            if split is not None and packing is None and num_real != input_ids.numel():  # (no filler: read whole)
                raise ValueError("a split block is read packed: real_lengths and num_real, on a cache that packs")
            attention_mask = self._attention_mask(position_ids, start, end, model.dtype, input_mask is None or all_real,
                                                  all_real, visibility)
            # (compiled, on the shapes as they come, for models that take the 2D mask; never the first forward)
            run = self._step_forward if step and self._step_forward is not None and self.cache.layers else model
            compiled_packing = self._compiled_packing(model, packing, input_mask, real_lengths, num_real, block,
                                                      logits_to_keep, first_row, split, prompt_lengths)
            if compiled_packing is not None:  # compiled on eager shapes: read packed, each layer's attention one op
                run, packing = self.eager_shapes_forward, compiled_packing
                extra = {**extra, "tetris_slots": self._slot_arguments(start, packing)}
                if attention_mask is None:  # (a tensor always, one graph: every cached slot real, causal in the block)
                    attention_mask = real_prefix_mask(self.slot_mask[:, None, None, :start], self._causal(end - start))
                attention_mask = standard_strides(attention_mask)  # (graphs are specialised on strides and views too)
            logits, features = self._eager_forward(run, input_ids, attention_mask, position_ids, packing,
                                                   logits_to_keep, discard_logits, split, extra, row_inputs)
        self.pointer, self.next_positions, self.longest_bound = end, next_positions, self.longest_bound + block
        self.block_start = start
        self.new_from = None  # (every row may now hold real tokens)
        self.dense = self.dense and all_real and visibility is None
        logits = None if discard_logits else logits
        return logits if hidden_states is None else (logits, features)

    def _later_slot(self, split: BlockSplit | None, input_mask: torch.Tensor | None,
                    real_lengths: torch.Tensor | None, num_real: int | None,
                    visibility: torch.Tensor | None) -> int | None:
        """Where a split block's later rows are written (:attr:`~tetris_hf.packing.Packing.later_slot`): from slot 0,
        their own holes, when they are the rows that joined since the last forward (nothing real in them) and the block
        is read packed on a plain sdpa layout (their attention then reads their own slots, causally); else ``None``,
        with the first rows at the pointer (a joining prompt of ``L`` tokens then widened every row by ``L`` slots,
        repacked away later, and grew the cache: docs/design.md, "The slot cache")."""
        if (split is None or self.new_from != split.rows or not self.packs or not self.layout.plain_sdpa
                or real_lengths is None or input_mask is not None or num_real is None or visibility is not None):
            return None
        return 0

    def _know(self, model: torch.nn.Module) -> None:
        """At the first forward: ``model``'s attention layout and, for an encoder-decoder's decoder (a model with a
        ``memory``, ``(B0, S, d)`` for the first batch), its cross-attention."""
        if self.layout is None:
            self.layout = AttentionLayout.of(model)
        if self.cross is None and getattr(model, "memory", None) is not None:
            self.cross = CrossAttention(model.memory[self.first_rows.to(model.memory.device)])
        # (graphs compiled on eager shapes take the buffers as inputs: they exist from the first forward)
        if self._on_eager_shapes and not self.cache.layers:
            self._allocate(model)

    @property
    def _on_eager_shapes(self) -> bool:
        """Forwards run :attr:`eager_shapes_forward` (set: a forward compiled on dynamic shapes,
        :func:`~tetris_hf.compiled.eager_shapes_forward`) where they can be read packed (:meth:`_compiled_packing`):
        on plain sdpa layouts (one boolean mask for every layer), for a decoder without cross-attention, on a cache
        that is not static."""
        return (self.eager_shapes_forward is not None and self.layout.plain_sdpa and self.cross is None
                and not self.static)

    def _allocate(self, model: torch.nn.Module) -> None:
        """Allocate every layer's buffers before the first forward, so that a forward compiled on eager shapes (which
        takes them as inputs) reads the first block too: their shapes come from a one-token forward into a
        transformers cache, thrown away."""
        from transformers import DynamicCache

        probe = DynamicCache(config=model.config)
        device = self.slot_mask.device
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), past_key_values=probe, use_cache=True)
        owner, rows = weakref.proxy(self), self.slot_mask.shape[0]
        for probed in probe.layers:
            layer = SlotLayer(owner)
            layer.lazy_initialization(probed.keys, probed.values)
            layer.keys, layer.values = layer.buffer_keys[:rows], layer.buffer_values[:rows]
            self.cache.layers.append(layer)

    def _compiled_packing(self, model: torch.nn.Module, packing: Packing | None, input_mask: torch.Tensor | None,
                          real_lengths: torch.Tensor | None, num_real: int | None, block: int, logits_to_keep: int,
                          first_row: int, split: BlockSplit | None, prompt_lengths: tuple[int, ...]) -> Packing | None:
        """The packing of a forward that runs :attr:`eager_shapes_forward`, or ``None``: the forward runs as it would
        without. It runs so where :attr:`_on_eager_shapes` says, once the buffers exist, while ``model`` runs the
        loop's attention (:func:`~tetris_hf.routing.routed_attention`, which hands the op its arguments), where the
        block can be read packed: every block is (a block without filler too, its packing trivial), so that one graph
        serves them all. Arguments as in :meth:`forward`; ``packing``: the block's own."""
        if not (self._on_eager_shapes and self.cache.layers and is_routed(model)):
            return None
        if packing is not None:
            return packing
        rows = self.slot_mask.shape[0]
        if logits_to_keep > 1 or input_mask is not None and num_real != rows * block:  # (filler not counted)
            return None
        lengths = torch.full((rows,), block, device=self.slot_mask.device) if real_lengths is None else real_lengths
        return Packing.of(lengths, rows * block, block, first_row=first_row, split=split, new_from=self.new_from,
                          prompt_lengths=prompt_lengths)

    def _slot_arguments(self, start: int, packing: Packing) -> SlotArguments:
        """What a compiled forward's attention op reads besides the layer's own tensors: every layer's buffers and the
        block's packing (:class:`~tetris_hf.slot_attention.SlotArguments`), the block written from slot ``start``.
        The buffers' heads and head size are constants of the graphs; their rows and capacity are not, so that a grown
        cache runs the graphs it has (a capacity the graphs fixed compiled every graph anew at each doubling, at
        points that differ run to run: docs/benchmarks.md), and so does a cache of another row count (the first-use
        measurement's: tetris_hf/compile_choice.py)."""
        keys, values = [], []
        for layer in self.cache.layers:
            for buffer, kept in ((layer.buffer_keys, keys), (layer.buffer_values, values)):
                if not hasattr(buffer, "_dynamo_static_indices"):
                    for dimension in (1, 3):
                        torch._dynamo.mark_static(buffer, dimension)
                kept.append(buffer)
        return SlotArguments(tuple(keys), tuple(values), packing.rows, packing.columns, packing.ends,
                             describe(start, self.slot_mask.shape[0], packing))

    def _check_block(self, model: torch.nn.Module, block: int, visibility: torch.Tensor | None,
                     split: BlockSplit | None, logits_to_keep: int) -> None:
        """Refuse a forward :meth:`forward` cannot run as asked (its arguments)."""
        if visibility is not None:
            check_tree_layout(self.layout, model)
            if visibility.shape[-1] > block and self.pointer + block > self.capacity:  # repacking would move them
                raise RuntimeError("a forward that sees slots written before it must fit the buffers: "
                                   "SlotCache.reserve before the first of them")
        if split is not None and logits_to_keep:
            raise ValueError("a split block keeps the logits the split says")

    @staticmethod
    def _routed(model: torch.nn.Module):
        """The loop's attention for ``model`` during a packed or grouped forward, where nobody routed it for longer
        (:func:`~tetris_hf.routing.routed_attention`: the loop does, for a whole call, the models that read so)."""
        return contextlib.nullcontext() if is_routed(model) else routed_attention(model)

    def _mark_slots(self, start: int, block: int, end: int, input_mask: torch.Tensor | None,
                    real_lengths: torch.Tensor | None, position_ids: torch.Tensor | None,
                    later: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | int]:
        """Record which of slots ``start..end - 1`` hold real tokens, and their positions, for a block of ``block``
        columns (other arguments as in :meth:`forward`); ``later``: ``(rows, slot, width)``, rows from ``rows`` on
        written from ``slot`` (their first ``block`` slots), the rows before them, ``width`` columns at most, from
        ``start`` to ``end``. Returns ``(B, L)`` the block's positions and the real tokens it adds per row, ``(B,)`` or
        ``L`` when all are real."""
        if position_ids is None and input_mask is None:  # positions go on from each row's cached tokens
            position_ids = self.next_positions[:, None]
            if block > 1:
                position_ids = position_ids + self.offsets[:block]
        elif position_ids is None:  # (filler's positions are never seen; given ones: a tree's nodes)
            # left filler takes the first real token's position, right filler the last's
            position_ids = self.next_positions[:, None] + (input_mask.cumsum(dim=1) - 1).clamp(min=0)
        if later is not None:  # (real_lengths given: see _later_slot)
            rows, slot, width = later
            self.slot_mask[:rows, start:end] = self.offsets[: end - start] < real_lengths[:rows, None]
            self.slot_positions[:rows, start : start + width] = position_ids[:rows, :width]
            self.slot_mask[rows:, slot : slot + block] = self.offsets[:block] < real_lengths[rows:, None]
            self.slot_positions[rows:, slot : slot + block] = position_ids[rows:]
            return position_ids, real_lengths
        if real_lengths is not None:
            self.slot_mask[:, start:end] = self.offsets[:block] < real_lengths[:, None]
            new_tokens = real_lengths
        elif input_mask is None:
            self.slot_mask[:, start:end] = True
            new_tokens = block
        else:
            self.slot_mask[:, start:end] = input_mask
            new_tokens = input_mask.sum(dim=1)
        self.slot_positions[:, start:end] = position_ids
        return position_ids, new_tokens

    def _attention_mask(self, position_ids: torch.Tensor, start: int, end: int, dtype: torch.dtype, real_prefix: bool,
                        all_real: bool, visibility: torch.Tensor | None):
        """The mask of a forward on the shapes as they come, writing slots ``start..end - 1``: one kind per layout
        and block, the cheapest that is exact (see :mod:`tetris_hf.attention`).

        Args:
            position_ids: ``(B, L)`` the block's positions.
            dtype: the model's dtype.
            real_prefix: every row's real tokens come first in the block (all real, or passed as ``real_lengths``).
            all_real: every token of the block is real.
            visibility: a draft tree's ancestor mask (see :meth:`forward`), or ``None``.
        """
        layout, real = self.layout, self.slot_mask
        if visibility is not None:  # a draft tree: each node sees the slots before the tree and its ancestors
            return position_masks(layout, self.slot_positions[:, :end], real[:, :end], position_ids, dtype, visibility)
        if not layout.prepared:  # causality by slot index is causality by position: the 2D mask of real slots
            return real[:, :end].long()
        if layout.plain_sdpa and all_real and start == 0:  # a first block, no filler: sdpa's own causality (faster)
            return None
        if layout.plain_sdpa and all_real and end - start == 1:  # one real token: no mask where every slot is real
            return None if self.dense else real[:, None, None, :end]
        if layout.plain_sdpa and real_prefix:  # the real cached slots, then causality within the block
            return real_prefix_mask(real[:, None, None, :start], self._causal(end - start))
        return position_masks(layout, self.slot_positions[:, :end], real[:, :end], position_ids, dtype)

    def _run(self, forward, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor,
             logits_to_keep: int | torch.Tensor, extra: dict):
        """``forward`` (the model's, or a compiled one) on the block, writing into this cache: its outputs.
        ``extra``: more arguments of the forward (hidden states asked for; the attention's)."""
        if torch.is_tensor(logits_to_keep) or logits_to_keep:
            extra = {**extra, "logits_to_keep": logits_to_keep}
        past_key_values, use_cache = self.cache, True
        if "tetris_slots" in extra:  # (the attention op writes the cache: the model is given none)
            past_key_values, use_cache = None, False
        if self.cross is not None:  # an encoder-decoder's decoder: its cross-attention beside the slots
            past_key_values, memory = self.cross.inputs(self.cache)
            extra = {**extra, **memory}
        return forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=past_key_values, use_cache=use_cache, **extra)

    @staticmethod
    def _features(outputs, extra: dict) -> torch.Tensor | None:
        """``(B, L, F)`` the hidden states ``extra`` asked for, concatenated in its order (``None``: none asked)."""
        layers = extra.get("output_hidden_states")
        return None if layers is None else select_features(outputs.hidden_states, layers)

    @property
    def packs(self) -> bool:
        """Steps with filler are read packed (:mod:`tetris_hf.packing`): asked for (:attr:`pack`, which
        :func:`~tetris_hf.packed_probe.packs_exactly` decides for a model) and the cache is not static (a static
        cache reads only its other blocks, prompts, packed)."""
        return self.pack and not self.static

    def _packing(self, input_mask: torch.Tensor | None, real_lengths: torch.Tensor | None, num_real: int | None,
                 width: int, logits_to_keep: int, first_row: int = 0, split: BlockSplit | None = None,
                 prompt_lengths: tuple[int, ...] = (), later_slot: int | None = None) -> Packing | None:
        """How a forward's block is read packed (arguments as in :meth:`forward`; ``later_slot``:
        :meth:`_later_slot`'s), or ``None``: read padded (no filler, real tokens not counted on the host, more than
        the last column's logits kept, or a cache that does not pack). A block whose later rows are written apart is
        always read packed."""
        if num_real is None or not self.pack or logits_to_keep > 1 or (input_mask is None and real_lengths is None):
            return None
        rows = (input_mask if real_lengths is None else real_lengths).shape[0]
        if not 0 < num_real < rows * width and later_slot is None:
            return None
        if real_lengths is not None:  # a verified block (or joining prompts): real tokens first
            new_from = self.new_from if self.layout.plain_sdpa else None
            return Packing.of(real_lengths, num_real, width, first_row=first_row, split=split, new_from=new_from,
                              prompt_lengths=prompt_lengths, later_slot=later_slot)
        return Packing.of_left_padded(input_mask, num_real)

    def _eager_forward(self, forward, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor,
                       packing: Packing | None, logits_to_keep: int, discard_logits: bool, split: BlockSplit | None,
                       extra: dict, row_inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None,
                                                                                  torch.Tensor | None]:
        """``forward`` on the shapes as they come: padded, or (``packing``) packed (:meth:`_packed_run`); its logits
        (arranged as :meth:`forward` says) and the features ``extra`` asked for."""
        if packing is not None:
            packed_inputs = {name: packing.pack(tensor)[None] for name, tensor in row_inputs.items()}
            logits, features = self._packed_run(forward, input_ids, attention_mask, position_ids, packing,
                                                logits_to_keep, discard_logits, {**extra, **packed_inputs})
            self.tokens_read = packing.num_tokens
            return logits, features
        outputs = self._run(forward, input_ids, attention_mask, position_ids, 1 if discard_logits else logits_to_keep,
                            {**extra, **row_inputs})
        self.tokens_read = input_ids.numel()
        logits = outputs.logits
        if split is not None and not discard_logits:  # every row is as long: later rows' last tokens last
            logits = _later_rows_last(logits[: split.rows, : split.width], logits[split.rows :, -1])
        return logits, self._features(outputs, extra)

    def _packed_run(self, forward, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor,
                    packing: Packing, logits_to_keep: int, discard_logits: bool,
                    extra: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``forward`` on the block's real tokens only, ``(1, N)``: its logits unpacked to ``(B, L, V)``, or with
        ``logits_to_keep`` (1) those of each row's last real token, ``(B, 1, V)``, the head computed at those ``B``
        tokens only (transformers' ``logits_to_keep`` as a tensor of sequence indices); ``None`` with
        ``discard_logits`` (the head computes one position); with a :class:`~tetris_hf.packing.BlockSplit`, those of
        its first rows only, ``(rows, width, V)``. The features ``extra`` asked for come unpacked, ``(B, L, F)``."""
        keep = 0  # every token's logits
        if discard_logits:
            keep = 1  # the head at one token, whichever
        elif logits_to_keep:
            keep = packing.ends - 1  # (B,) each row's last token in the packed sequence
        elif packing.split is not None:  # the first rows' tokens, then each later row's last
            first_tokens = torch.arange(packing.split.tokens, device=packing.rows.device)
            keep = torch.cat([first_tokens, packing.ends[packing.split.rows :] - 1])
        # (a forward compiled on eager shapes: its attention op writes and unpacks, on a model routed already; the
        # logits it keeps always a tensor of token indices, so that every read is one graph's)
        compiled = "tetris_slots" in extra
        if compiled and not torch.is_tensor(keep):
            # (keep 0: every token; a fresh tensor, not a slice: its storage offset would be a graph's constant)
            keep = torch.arange(packing.num_tokens - keep if keep else 0, packing.num_tokens, device=packing.rows.device)
        packed = {} if compiled else {"tetris_packing": packing}
        self.packing = packing
        try:
            with contextlib.nullcontext() if compiled else self._routed(forward):
                outputs = self._run(forward, packing.pack(input_ids)[None], attention_mask,
                                    packing.pack(position_ids)[None], keep, {**extra, **packed})
        finally:
            self.packing = None
        features = self._features(outputs, extra)
        features = None if features is None else packing.unpack(features[0])
        logits = outputs.logits
        if discard_logits:
            return None, features
        if logits_to_keep:
            return logits[0][:, None], features
        if packing.split is None:
            return packing.unpack(logits[0]), features
        tokens = packing.split.tokens
        return _later_rows_last(packing.first_rows().unpack(logits[0, :tokens]), logits[0, tokens:]), features

    def _static_forward(self, model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, start: int,
                        end: int, logits_to_keep: int, extra: dict,
                        row_inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:attr:`step_forward` on static shapes: the batch padded with dummy rows to
        :func:`~tetris_hf.static_shapes.batch_bucket` rows, masks over the whole capacity, keys and values written at
        ``write_index`` (slots ``start..end - 1``); on sdpa, each key-value head read in place by its query heads.
        Returns the real rows' logits and features, as :meth:`forward` (docs/design.md, "The slot cache")."""
        rows = input_ids.shape[0]
        extra_rows = batch_bucket(rows, self.cache.layers[0].static_keys.shape[0]) - rows  # (the buffers' rows)
        key_valid, key_positions = self.slot_mask, self.slot_positions
        if extra_rows:  # dummy rows: every slot real, at position 0, queried from position 0
            pad = (0, 0, 0, extra_rows)
            input_ids = torch.nn.functional.pad(input_ids, pad)
            position_ids = torch.nn.functional.pad(position_ids, pad)
            key_valid = torch.nn.functional.pad(key_valid, pad, value=True)
            key_positions = torch.nn.functional.pad(key_positions, pad)
            row_inputs = {name: torch.nn.functional.pad(tensor, (0, 0, *pad)) for name, tensor in row_inputs.items()}
        input_ids, position_ids = standard_strides(input_ids), standard_strides(position_ids)
        extra = {**extra, **{name: standard_strides(tensor) for name, tensor in row_inputs.items()}}
        attention_mask = position_masks(self.layout, key_positions, key_valid, position_ids, model.dtype)
        grouped = self.layout.implementation == "sdpa" and takes_attention_arguments(model)
        self.write_index = self.offsets[start:end]
        try:
            with self._routed(model) if grouped else contextlib.nullcontext():
                outputs = self._run(self._step_forward, input_ids, attention_mask, position_ids, logits_to_keep,
                                    {**extra, "tetris_grouped": True} if grouped else extra)
        finally:
            self.write_index = None
        self.tokens_read = (rows + extra_rows) * (end - start)
        features = self._features(outputs, extra)
        return outputs.logits[:rows], None if features is None else features[:rows]

    def _causal(self, block: int) -> torch.Tensor:
        """``(block, block)`` bool, True on and below the diagonal (kept, and grown, across forwards)."""
        if self.causal is None or self.causal.shape[0] < block:
            self.causal = torch.ones(block, block, dtype=torch.bool, device=self.slot_mask.device).tril()
        return self.causal[:block, :block]

    def prefill(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                num_real: int | None = None, row_inputs: dict[str, torch.Tensor] | None = None) -> None:
        """Cache a left-padded block ``(B, T)`` (a prompt, or tokens a draft skipped) but its last column, which
        opens the next block and is real in every row. ``num_real``: the block's real tokens, known on the host: the
        columns read are then read packed where the model can be (:attr:`packs`). ``row_inputs``: as in
        :meth:`forward`, ``(B, T, F)`` each (their last column is not read either)."""
        if input_ids.shape[1] > 1:
            read = None if num_real is None else num_real - input_ids.shape[0]  # (the last column: one per row)
            inputs = {name: tensor[:, :-1] for name, tensor in (row_inputs or {}).items()}
            self.forward(model, input_ids[:, :-1], attention_mask[:, :-1], num_real=read, discard_logits=True,
                         row_inputs=inputs)

    def keep_prefix(self, start: int, keep: torch.Tensor) -> None:
        """Roll back a block written at ``start`` whose real tokens come first in every row: row ``i`` keeps its first
        ``keep[i]`` ``(R,)`` slots, at most its real ones, the rest become holes (e.g. ``[[a b c], [d e .]]`` with keep
        ``[1, 2]`` -> ``[[a . .], [d e .]]``); rows from ``R`` on keep what they hold (rows whose prompts the block
        read, written apart: :meth:`_later_slot`)."""
        if start == self.pointer:
            return
        self.dense = False
        rows = keep.shape[0]
        self.slot_mask[:rows, start : self.pointer] = self.offsets[: self.pointer - start] < keep[:, None]
        kept = self.slot_positions[:rows, start] + keep
        self.next_positions = kept if rows == self.next_positions.shape[0] else torch.cat([kept,
                                                                                           self.next_positions[rows:]])

    def keep_slots(self, start: int, keep: torch.Tensor) -> None:
        """Roll back a draft tree written from slot ``start`` (its root, real and kept in every row): row ``i`` keeps
        the slots where ``keep[i]`` is True, ``keep`` ``(B, pointer - start)`` bool, which must hold consecutive
        positions from the root (the accepted path); the others become holes."""
        kept = self.slot_mask[:, start : self.pointer]  # a view: changed in place
        kept &= keep
        self.dense = False
        self.next_positions = self.slot_positions[:, start] + kept.sum(dim=1)

    def reserve(self, slots: int) -> None:
        """Make room now for ``slots`` more slots per row (repacking or growing), so that the forwards writing them
        (a draft tree's, whose slot indices must not move) do not."""
        self._make_room(slots)

    def fill_rows(self, targets: torch.Tensor, sources: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Keep the first ``num_rows`` rows, row ``sources[i]`` taking the place of row ``targets[i]`` (finished rows
        leave; e.g. ``[a b c d]``, ``targets [1]``, ``sources [3]``, ``num_rows`` 2 -> ``[a d]``). Only the moved rows'
        written slots are copied, in place.

        Args:
            targets: ``(M,)`` distinct rows below ``num_rows``.
            sources: ``(M,)`` rows; ``sources[i] == targets[i]`` moves nothing.

        Returns:
            ``(num_rows,)`` each remaining row's former index.
        """
        rows = rows_after_fill(targets, sources, num_rows)
        self.new_from = None  # (rows move: which are new is no longer known)
        self.slot_mask, self.slot_positions = self.slot_mask[rows], self.slot_positions[rows]
        self.next_positions = self.next_positions[rows]
        self.first_rows = self.first_rows[rows]
        if self.cross is not None:
            self.cross.select(rows)
        for layer in self._layers():  # layers may sit on different devices (a model split by accelerate)
            layer.fill_rows(targets, sources, num_rows, self.pointer)
        return rows

    def add_rows(self, count: int) -> None:
        """``count`` empty rows join after the active ones (a request stream's new requests): every slot written so
        far is a hole in them and their next position is 0. Nothing is copied; the buffers grow only if
        :attr:`max_rows` was too small (a static cache's then give its padded batches a new bucket)."""
        if count <= 0:
            return
        if self.cross is not None:
            raise RuntimeError("an encoder-decoder's cache cannot take rows mid-call (their encoder outputs are not here)")
        if self.new_from is None:
            self.new_from = self.slot_mask.shape[0]
        self.dense = self.dense and self.pointer == 0
        self.first_rows = torch.nn.functional.pad(self.first_rows, (0, count), value=-1)
        extra = (0, 0, 0, count)
        self.slot_mask = torch.nn.functional.pad(self.slot_mask, extra)
        self.slot_positions = torch.nn.functional.pad(self.slot_positions, extra)
        self.next_positions = torch.nn.functional.pad(self.next_positions, (0, count))
        num_rows = self.slot_mask.shape[0]
        for layer in self._layers():
            layer.add_rows(num_rows)

    def live_lengths(self) -> torch.Tensor:
        """``(B,)`` real tokens cached per row (the next token's position). Their maximum bounds every row's real
        slots (equal to them but on windowed models, whose expired slots became holes): the loop reads it with its
        other numbers and hands it back to :meth:`compact`, so that repacking needs no read of its own."""
        return self.next_positions

    def compact(self, longest: int | None = None, force: bool = False) -> None:
        """Move each row's real slots at or past ``width``, a host bound on any row's real slots, into its first holes
        before it, in order, and move the pointer to ``width``, when the cache holds more than ``max_holes`` slots
        beyond it (e.g. rows ``[a b . c | . . d e]`` at width 3 -> ``[a b c | e . d]``; ``[. a b c d]`` at 4 ->
        ``[d a b c]``). Slots before the width stay where they are, so a repack copies only what lies past it (after
        rolled-back drafts, each row's few last tokens; after a prompt read in forwards of its own joins a stream, that
        prompt: one riding in a step's forward lies in its row's first slots already); a row's slots need not be in
        position order (masks and attention go by each slot's position). On models whose every layer has a window,
        slots no future query can see become holes first.

        Args:
            longest: an upper bound on the real slots any row holds now (e.g. the most :meth:`live_lengths` read
                after the last forward); without it, the cache's own bound (every block counted in full).
            force: repack whatever the holes.
        """
        if longest is not None:
            self.longest_bound = min(self.longest_bound, int(longest))
        if self.pointer == 0:
            return
        reach = self.layout.reach if self.layout is not None else None
        if reach is not None:  # older than every window of the next query (position >= next_positions)
            expired = self.slot_positions[:, : self.pointer] <= (self.next_positions - reach)[:, None]
            self.slot_mask[:, : self.pointer].masked_fill_(expired, False)
            self.dense = False
            self.longest_bound = min(self.longest_bound, reach)  # positions next - reach + 1 .. next - 1 remain
        width = min(self.longest_bound, self.pointer)
        if not force and self.pointer - width <= self.max_holes:
            return
        order, filled = self._hole_filling(width)
        self.slot_positions[:, :width] = self.slot_positions.gather(1, order)
        self.slot_mask[:, :width] |= filled
        self.slot_mask[:, width:] = False
        self.dense = False  # (holes may remain anywhere before the width)
        moves = None
        if self.slot_mask.device.type == "cpu":  # only the slots that move (listing them is a host read elsewhere)
            rows, targets = filled.nonzero(as_tuple=True)  # (the filled holes: every other slot stays put)
            moves = (rows, targets, order[rows, targets])
        flat_index: dict = {}
        for layer in self._layers():
            layer.repack(order, flat_index, moves if layer.keys.is_contiguous() else None)
        self.pointer = width

    def _hole_filling(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each slot of ``[0, width)`` comes from in a repack to ``width`` (:meth:`compact`): ``order`` ``(B,
        width)``, the slot itself, or for a row's ``i``-th hole the row's ``i``-th real slot at or past the width
        (its holes outnumber those: no row holds more than ``width`` real slots); ``filled`` ``(B, width)`` the holes
        that take one. No host read."""
        beyond = self.slot_mask[:, width : self.pointer]  # (B, P - W) real slots that must move
        holes = ~self.slot_mask[:, :width]
        # source_of[b, i]: row b's i-th (1-based) real slot past the width (column 0 collects the other slots)
        source_of = torch.zeros(beyond.shape[0], beyond.shape[1] + 1, dtype=torch.long, device=beyond.device)
        source_of.scatter_(1, beyond.cumsum(dim=1) * beyond, self.offsets[width : self.pointer].expand_as(beyond))
        hole_rank = holes.cumsum(dim=1)
        filled = holes & (hole_rank <= beyond.sum(dim=1, keepdim=True))
        sources = source_of.gather(1, hole_rank.clamp(max=beyond.shape[1]))
        return torch.where(filled, sources, self.offsets[:width]), filled

    def _make_room(self, block: int, reach: int = 0) -> None:
        """Repack, then grow the buffers, until ``block`` more slots fit past the pointer, and ``reach`` slots from
        the first."""
        if self.pointer + block <= self.capacity and reach <= self.capacity:
            return
        self.compact(force=True)
        if self.pointer + block <= self.capacity and reach <= self.capacity:
            return
        capacity = max(2 * self.capacity, self.pointer + block, reach)
        capacity = static_capacity(capacity) if self.static else capacity
        extra = capacity - self.capacity
        # (a static cache: new shapes, so new graphs; slots_needed sizes a generate() call's never to grow)
        self.slot_mask = torch.nn.functional.pad(self.slot_mask, (0, extra))
        self.slot_positions = torch.nn.functional.pad(self.slot_positions, (0, extra))
        for layer in self._layers():
            layer.rebuild(lambda tensor: torch.nn.functional.pad(tensor, (0, 0, 0, extra)))
        self.capacity = capacity
        self.offsets = torch.arange(capacity, device=self.offsets.device)

    def _layers(self) -> list[SlotLayer]:
        return [layer for layer in self.cache.layers if layer.is_initialized]
