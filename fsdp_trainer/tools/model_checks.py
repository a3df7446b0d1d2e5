"""Checks of a team's own model (train.main's model_fn), before it is sharded and at its first forward: mistakes
that would otherwise fail obscurely (in sharding, materializing, or the first step as a device-side assert) or do
wrong unsaid. Each is named in one ConfigError, which main() prints as one line."""

from __future__ import annotations

import inspect
from typing import Iterable, Sequence

import torch
from torch import nn

from fsdp_trainer.config import Config, ConfigError, check_block_counts
from fsdp_trainer.models.llama import model_args_from_config
from fsdp_trainer.parallelize import blocks_of, reset_of

GROUPS_FORM = "groups is a list of lists of modules, e.g. [[model.embed], [model.norm, model.head]], or [] for none"


def check_own_model(built, cfg: Config) -> tuple[nn.Module, Sequence[type], list[list[nn.Module]]]:
    """model_fn's (model, block classes, groups), checked against the run's settings and the data's vocabulary;
    the token embedding and the logits are checked at the first forward. Returns them, the groups as lists (model_fn
    may give generators, which sharding would read again)."""
    if not (isinstance(built, (tuple, list)) and len(built) == 3 and isinstance(built[0], nn.Module)):
        got = f"a {type(built).__name__}" + (f" of {len(built)}" if isinstance(built, (tuple, list)) else "")
        raise ConfigError(f"model_fn returned {got}, but must return (model, block classes, groups), e.g. "
                          "(model, (MyBlock,), []), with [] for no groups")
    model, block_types, groups = built
    name, vocab_size = type(model).__name__, model_args_from_config(cfg.model).vocab_size
    try:
        blocks, groups = check_units(model, block_types, groups)
        if any(param.is_meta for param in model.parameters()):  # as build_model decides to call init_weights
            check_initializable(model)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{name} as model_fn returned it: {err}") from None
    # The largest embedding may be a position table: check_token_embedding_once checks the one the tokens index.
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    if sizes and max(sizes) < vocab_size:
        raise _too_few_rows(name, "largest embedding", max(sizes), vocab_size)
    max_seq_len = getattr(model, "max_seq_len", None)
    if max_seq_len is not None and cfg.train.seq_len > max_seq_len:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} exceeds {name}.max_seq_len={max_seq_len}: lower "
                          "--train.seq_len, or build the model with a longer context")
    check_block_counts(cfg, len(blocks))
    if cfg.train.loss_chunk_tokens:
        try:
            inspect.signature(model.forward).bind(None, None, None)
        except TypeError:
            raise ConfigError(f"train.loss_chunk_tokens needs {name}.forward(tokens, labels, chunk_tokens) "
                              f"returning the mean loss, but its forward takes {inspect.signature(model.forward)}: "
                              "set --train.loss_chunk_tokens 0") from None
    else:  # else forward returns the loss
        check_logits_once(model, vocab_size)
    check_token_embedding_once(model, vocab_size)
    return model, block_types, groups


def check_units(model: nn.Module, block_types: Sequence[type], groups: Iterable[Iterable[nn.Module]] = ()
                ) -> tuple[list[nn.Module], list[list[nn.Module]]]:
    """The blocks and groups apply_fsdp would shard, refused where fully_shard would do wrong unsaid (master weights
    in 16 bits) or fail obscurely, late or on every rank (groups in another form, an empty group, a module in two
    units, a tie split across units)."""
    low = [name for name, param in model.named_parameters()
           if param.requires_grad and param.dtype in (torch.bfloat16, torch.float16)]
    if low:  # frozen parameters have no master weights: a 16-bit frozen base is the model's own choice
        raise ValueError(f"trainable parameters in 16 bits ({', '.join(low[:4])}{' ...' if len(low) > 4 else ''}), "
                         "but the sharded parameters are the optimizer's master weights; build the model in float32 "
                         "(param_dtype is the dtype forward and backward compute in)")
    blocks = blocks_of(model, block_types)
    # A module given as a group would be read child by child (a Sequential of blocks), or fail obscurely.
    items = [groups] if isinstance(groups, nn.Module) else list(groups)
    bad = [type(group).__name__ for group in items if not isinstance(group, Iterable)
           or (isinstance(group, nn.Module) and not isinstance(group, nn.ModuleList))]
    if bad:
        raise TypeError(f"groups holds an item of type {bad[0]} where a list of modules belongs: {GROUPS_FORM}")
    groups = [list(group) for group in items]
    bad = [type(module).__name__ for group in groups for module in group if not isinstance(module, nn.Module)]
    if bad:
        raise TypeError(f"a group holds an item of type {bad[0]}, not a module: {GROUPS_FORM}")
    if not all(groups):
        raise ValueError("a group in `groups` is empty: each group lists the modules that share one all-gather")
    # fully_shard fails on a module in two units (nested included) with a bare assertion or an invariant error.
    names = {id(module): name for name, module in model.named_modules()}
    units = [*blocks, *(module for group in groups for module in group)]
    holder: dict[int, int] = {}  # id(module) -> the index in units of the first that holds it
    for index, unit in enumerate(units):
        for sub in unit.modules():
            first = holder.setdefault(id(sub), index)
            if first == index:
                continue
            where = f"{names.get(id(sub), type(sub).__name__)} is in two FSDP units"
            if index < len(blocks):  # blocks come outer first, as modules() lists them
                outer = units[first]
                raise ValueError(f"{where}: the block class {type(unit).__name__} matches modules inside another "
                                 f"block ({names[id(outer)]}, of class {type(outer).__name__}): give block_types the "
                                 "class of the outermost repeated blocks only")
            raise ValueError(f"{where} (listed twice, a block also in a group, or a group inside or around another "
                             "unit): give each module to one unit only")
    _check_ties(model, blocks, groups, names)
    return blocks, groups


def _check_ties(model: nn.Module, blocks: list[nn.Module], groups: list[list[nn.Module]], names: dict) -> None:
    """Refuse a parameter shared by two sharding units (a block, a group, or the root): each unit would shard a
    copy of its own."""
    unit_of = {id(block): f"block {names[id(block)]}" for block in blocks}
    block_units = set(unit_of.values())
    for group in groups:
        unit_of.update({id(module): "group [" + ", ".join(names[id(m)] for m in group) + "]" for module in group})
    owner: dict[int, tuple[str, str]] = {}  # id(parameter) -> (its first name, its unit)

    def visit(module: nn.Module, prefix: str, unit: str) -> None:
        unit = unit_of.get(id(module), unit)  # a module belongs to the innermost unit around it
        for name, param in module.named_parameters(prefix=prefix, recurse=False):
            first, first_unit = owner.setdefault(id(param), (name, unit))
            if first_unit == unit:
                continue
            users = " and ".join(n.rpartition(".")[0] or "the model itself" for n in (first, name))
            tied = (f"{name} (in {unit}) is the same parameter as {first} (in {first_unit}), tied weights, which "
                    "must live in one FSDP unit")
            if {unit, first_unit} & block_units:  # a module inside a block cannot join a group, nor the root
                raise ValueError(f"{tied}, and a block's unit is the block: hold the shared weight in one module "
                                 "registered once on the model, outside the blocks (the root or a group of its own "
                                 f"then holds it), or pass block classes whose modules contain all its users ({users})")
            raise ValueError(f"{tied}: put the modules that share it ({users}) in one group, or leave them all out "
                             "of `groups` so that the root holds them")
        for name, child in module.named_children():
            visit(child, f"{prefix}.{name}" if prefix else name, unit)

    visit(model, "", "the root (what no block or group holds)")


def check_initializable(model: nn.Module) -> None:
    """Refuse a meta-device model with parameters or buffers that parallelize.init_weights would leave as
    materialized, uninitialized memory: a parameter counts as filled by init_param or where its module or one around
    it resets, a buffer by init_buffers or its own module's reset only."""
    unset: list[str] = []
    seen: set[int] = set()

    def visit(module: nn.Module, prefix: str, reset_around: bool) -> None:
        seen.add(id(module))
        resets = reset_of(module) is not None
        if not (hasattr(model, "init_param") or resets or reset_around):
            unset.extend(name for name, _ in module.named_parameters(prefix, recurse=False))
        if not (hasattr(model, "init_buffers") or resets):
            unset.extend(name for name, _ in module.named_buffers(prefix, recurse=False))
        for name, child in module.named_children():
            if id(child) not in seen:
                visit(child, f"{prefix}.{name}" if prefix else name, reset_around or resets)

    visit(model, "", False)
    if unset:
        raise ValueError(f"init_weights cannot initialize {', '.join(unset[:4])}{' ...' if len(unset) > 4 else ''}: "
                         "materialized from meta they would hold garbage, and no reset_parameters() of their module "
                         "(or, for parameters, of a module around it) fills them; give the model init_param(name, "
                         "full_tensor, generator) for parameters and init_buffers() for buffers, or "
                         "reset_parameters() to their modules")


def _too_few_rows(name: str, embedding: str, rows: int, vocab_size: int) -> ConfigError:
    return ConfigError(f"{name}'s {embedding} has {rows} rows, but the data may hold ids up to "
                       f"model.vocab_size={vocab_size}: set --model.vocab_size {rows} (the data are checked against "
                       "it), or build the model with that vocabulary")


def check_token_embedding_once(model: nn.Module, vocab_size: int) -> None:
    """At the first forward, before the lookup: the embedding called with the very tensor model() was must have
    vocab_size rows (an id past it is an IndexError, a device-side assert on GPUs). Identity and sizes only, no
    sync; the hooks are removed after the first forward."""
    name = type(model).__name__
    names = {id(module): module_name for module_name, module in model.named_modules()}
    tokens: list[torch.Tensor] = []

    def record(module: nn.Module, inputs: tuple) -> None:
        tokens[:] = inputs[:1]

    def check(embedding: nn.Embedding, inputs: tuple) -> None:
        if tokens and inputs and inputs[0] is tokens[0] and embedding.num_embeddings < vocab_size:
            remove()
            raise _too_few_rows(name, f"token embedding {names[id(embedding)]}", embedding.num_embeddings, vocab_size)

    def remove(*unused) -> None:
        tokens.clear()
        for handle in handles:
            handle.remove()

    handles = [model.register_forward_pre_hook(record)]
    handles += [module.register_forward_pre_hook(check) for module in model.modules()
                if isinstance(module, nn.Embedding)]
    handles.append(model.register_forward_hook(remove))


def check_logits_once(model: nn.Module, vocab_size: int) -> None:
    """At the first forward: the loss takes one tensor of logits, (batch, seq_len, at least vocab_size). Shapes
    only, no sync; once, as the model is the user's after training (generation may return more)."""
    def check(module: nn.Module, inputs: tuple, logits) -> None:
        tokens = inputs[0]
        if not isinstance(logits, torch.Tensor) or logits.shape[:-1] != tokens.shape or logits.shape[-1] < vocab_size:
            got = f"a tensor of shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor) else \
                f"a {type(logits).__name__}"
            raise ConfigError(f"model(tokens) returned {got} for tokens of shape {tuple(tokens.shape)}: the trainer "
                              "needs the logits alone, one tensor of shape (batch, seq_len, vocab_size) with "
                              f"vocab_size at least model.vocab_size={vocab_size}, which the data's ids are checked "
                              "against")
        handle.remove()

    handle = model.register_forward_hook(check)
