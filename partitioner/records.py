"""Typed records shared by every part of hethub: one frozen pydantic model per concept.

Why pydantic: each record validates in its constructor (torchtitan style), so a
bad file is refused where it is read, and JSON round trips come for free.
Cross-field checks raise ``ValueError("field: message, got value")``;
``errors.from_validation_error`` turns them into one user-facing line.

Units: ``*_ms`` milliseconds, ``*_bytes`` bytes, ``memory_gib`` GiB,
``memory_gbps`` GB/s (gigaBYTES, as in datasheets), network ``*_gbps``
Gbit/s (gigaBITS, as NICs are sold), ``peak_tflops`` dense TFLOP/s.
"""
from __future__ import annotations

import functools
import json
import os
import re
from functools import cached_property
from typing import Annotated, Any, Literal, NamedTuple, Optional, TypeVar, Union

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from .catalogue import DEVICE_TYPES, MODELS
from .errors import InputError, from_validation_error, short
from .schedule_kinds import KINDS, kind

SCHEMA_VERSION = 1

# Bounds on sizes, so that hopeless input is refused where it is read instead of exhausting memory or
# time later (README, "Limits"). Generous for any real fleet or model.
MAX_NAME_CHARS = 256  # names of hosts, device types, models, clusters
MAX_DEVICES = 65_536  # devices in a cluster (and ranks in a plan)
MAX_BLOCKS = 10_000  # transformer blocks in a model
MAX_DIM = 10_000_000  # hidden, ffn, vocab, sequence length, heads
MAX_BATCH = 10_000_000  # samples in a global batch
MAX_MICRO_BATCHES = 100_000  # micro-batches in one iteration
MAX_RATE = 1e9  # TFLOP/s, GiB, GB/s, Gbit/s, microseconds: finite and at most this
PassMs = Annotated[float, Field(ge=0, le=MAX_RATE, allow_inf_nan=False)]  # one compute pass, milliseconds
MIN_RATE = 1e-6  # TFLOP/s, GB/s, Gbit/s: more than this (1e-300 made the MILP's coefficients overflow)

Name = Field(min_length=1, max_length=MAX_NAME_CHARS)
# What a hostfile line and an ssh/pdsh argument can carry safely: a host name or an address, never a flag
# ("-oProxyCommand=...") or a second hostfile line ("n2 slots=64\nevil").
_HOST = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9_])?|[0-9A-Fa-f:]*:[0-9A-Fa-f:.]+")


def check_host(host: str) -> str:
    """A host name (letters, digits, '.', '-', '_', not starting with '-') or an IP address; else ValueError."""
    if not _HOST.fullmatch(host):
        raise ValueError(f"{short(host)} is not a host name or address (letters, digits, '.', '-' and '_', not "
                         "starting with '-'): it would reach a hostfile and ssh")
    return host


class Record(BaseModel):
    """Base: frozen, no unknown fields, JSON round trip."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent, exclude_none=True)

    @classmethod
    def from_json(cls, text: str, prefix: str = ""):
        return parse_record(cls, json.loads(text), prefix or cls.__name__.lower())


R = TypeVar("R", bound=BaseModel)


def parse_record(cls: type[R], data: Any, prefix: str) -> R:
    """Validate ``data`` as ``cls``; any error becomes one InputError whose field starts with ``prefix``."""
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc, prefix) from None
    except UnicodeEncodeError:  # a lone surrogate (JSON's "\ud800"), which no text field can hold
        raise InputError(prefix, "holds text that is not valid Unicode (a lone surrogate)") from None


MAX_FILE_BYTES = 64 * 2 ** 20  # a cluster, model, profile or plan file


MAX_YAML_NODES = 1_000_000  # values a YAML file may stand for once its aliases are expanded


def _check_yaml_expansion(text: str, path: str, what: str) -> None:
    """Refuse a YAML file whose aliases expand past ``MAX_YAML_NODES`` values (an alias bomb: a few lines that
    every later reader, validation included, would walk exponentially many times) or refer to themselves. The
    composed node graph shares aliased nodes, so counting what they expand to takes one pass over it."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return  # safe_load reports the same error next, with its line
    if root is None:
        return
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode)
                    else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if done:
            on_path.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > MAX_YAML_NODES:
                raise InputError(what, f"{path}: its aliases expand to over {MAX_YAML_NODES} values; refused "
                                       f"unread (an alias bomb?)")
            continue
        if id(node) in sizes:
            continue
        if id(node) in on_path:
            raise InputError(what, f"{path}: an alias refers to a node that contains it (a recursive structure)")
        on_path.add(id(node))
        stack.append((node, True))
        stack += [(c, False) for c in children if id(c) not in sizes]


def read_data_file(path: str, what: str) -> Any:
    """Read a JSON or YAML file (YAML with safe_load; JSON is YAML too, but JSON errors read better).

    Every way a file can be unreadable (missing, a directory, too large, not UTF-8, nested past the
    parser's recursion limit, an integer past Python's 4300-digit limit) is one InputError."""
    if os.path.isdir(path):
        raise InputError(what, f"{short(path)} is a directory, not a file")
    if not os.path.isfile(path):
        raise InputError(what, f"no such file {path!r}")
    try:
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise InputError(what, f"{path}: {size} bytes; at most {MAX_FILE_BYTES} bytes are read")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise InputError(what, f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise InputError(what, f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        if path.endswith(".json"):
            return json.loads(text)
        _check_yaml_expansion(text, path, what)
        return yaml.safe_load(text)
    except InputError:
        raise
    except RecursionError:
        raise InputError(what, f"{path}: nested too deeply") from None
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError):
            raise InputError(what, f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: "
                                   f"{exc.msg})") from None
        if "integer string conversion" in str(exc):  # Python's limit; its message names sys.set_int_max_str_digits
            raise InputError(what, f"{path}: holds an integer of over 4300 digits; no field takes one") from None
        raise InputError(what, f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise InputError(what, f"{path}: not valid YAML{where}") from None


# ---------------------------------------------------------------- devices


class DeviceType(Record):
    name: str = Field(default="", max_length=MAX_NAME_CHARS)
    vendor: Literal["nvidia", "amd", "intel", "cpu", "other"]
    # dtype -> dense peak TFLOP/s; a bare number means bf16 (and fp16).
    peak_tflops: dict[str, float]
    memory_gib: float = Field(gt=0, le=MAX_RATE, allow_inf_nan=False)
    memory_gbps: float = Field(gt=MIN_RATE, le=MAX_RATE, allow_inf_nan=False)
    # Fraction of peak a transformer layer's matmuls reach (MFU); a measured profile calibrates it.
    efficiency: float = Field(default=0.5, gt=0, le=1, allow_inf_nan=False)
    # Price of one device-hour (cloud list price or amortised cost), for $/1M tokens and --objective cost.
    usd_per_hour: Optional[float] = Field(default=None, ge=0, le=MAX_RATE, allow_inf_nan=False)

    @field_validator("peak_tflops", mode="before")
    @classmethod
    def _number_means_bf16(cls, v: Any) -> Any:
        if isinstance(v, str):  # YAML 1.1 reads 1e-3 (no dot) as a string; every other number field takes it
            try:
                v = float(v)
            except ValueError:
                raise ValueError(f"expected TFLOP/s (a number) or a map dtype -> TFLOP/s, got {short(v)}") from None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return {"bf16": float(v), "fp16": float(v)}
        if not isinstance(v, dict):
            raise ValueError(f"expected TFLOP/s (a number) or a map dtype -> TFLOP/s, got {short(v)}")
        return v

    @field_validator("peak_tflops")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("must name at least one dtype")
        for dtype, tf in v.items():
            if dtype not in ("fp8", "bf16", "fp16", "tf32", "fp32", "fp64"):
                raise ValueError(f"{dtype[:40]}: unknown dtype, expected one of fp8/bf16/fp16/tf32/fp32/fp64")
            if not tf > MIN_RATE:
                raise ValueError(f"{dtype}: must be > {MIN_RATE:g} TFLOP/s, got {tf!r}")
            if not tf <= MAX_RATE:
                raise ValueError(f"{dtype}: must be <= {MAX_RATE:g}, got {tf!r}")
        return v

    def native(self, dtype: str) -> bool:
        """Whether the type computes ``dtype`` in hardware (lists a peak for it)."""
        return dtype in self.peak_tflops

    def peak(self, dtype: str = "bf16") -> float:
        """Dense peak TFLOP/s for ``dtype`` as the type runs it: a 16-bit dtype it lacks (bf16 on V100, T4) runs
        without tensor cores, so it is priced at the fp32 peak (pricing V100 bf16 at its fp16 tensor-core peak
        overrated it ~8x); an fp32 a user type does not list falls back to its 16-bit peak."""
        chain = (dtype, "fp32") if dtype in ("bf16", "fp16", "fp8") else (dtype, "bf16", "fp16")
        for d in chain:
            if d in self.peak_tflops:
                return self.peak_tflops[d]
        return max(self.peak_tflops.values())


@functools.lru_cache(maxsize=None)
def builtin_device_type(name: str) -> DeviceType:
    """A catalogue entry as a record (cached: records are frozen, and cost lookups ask for them in hot loops)."""
    if name not in DEVICE_TYPES:
        raise InputError("device_type", f"unknown device type {name!r} (built-in: {', '.join(DEVICE_TYPES)})")
    return DeviceType(name=name, **DEVICE_TYPES[name])


# ---------------------------------------------------------------- cluster


class Node(Record):
    host: str = Name
    device_type: str = Name
    count: int = Field(gt=0, le=MAX_DEVICES)

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        return check_host(v)


class Network(Record):
    # Gbit/s between two devices of one node; one number or a map device_type -> number.
    intra_node_gbps: Union[float, dict[str, float]] = 2400.0
    # Gbit/s of one node's NIC towards another node.
    inter_node_gbps: float = Field(default=100.0, gt=MIN_RATE, le=MAX_RATE, allow_inf_nan=False)
    # Between devices of different vendors, traffic goes device -> host -> network -> host -> device.
    # None: inter_node_gbps, limited by host copies (PCIe) in the cost model.
    cross_vendor_gbps: Optional[float] = Field(default=None, gt=MIN_RATE, le=MAX_RATE, allow_inf_nan=False)
    intra_node_latency_us: float = Field(default=5.0, ge=0, le=MAX_RATE, allow_inf_nan=False)
    inter_node_latency_us: float = Field(default=20.0, ge=0, le=MAX_RATE, allow_inf_nan=False)

    @field_validator("intra_node_gbps")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        values = v.items() if isinstance(v, dict) else [("", v)]
        for k, x in values:
            if not MIN_RATE < x <= MAX_RATE:
                raise ValueError(f"{k[:40] + ': ' if k else ''}must be > {MIN_RATE:g} and <= {MAX_RATE:g}, got {x!r}")
        return v

    def intra_gbps(self, device_type: str) -> float:
        if isinstance(self.intra_node_gbps, dict):
            # A type missing from the map gets the slowest listed link: never optimistic.
            return self.intra_node_gbps.get(device_type, min(self.intra_node_gbps.values()))
        return float(self.intra_node_gbps)


class Cluster(Record):
    name: str = Field(default="cluster", max_length=MAX_NAME_CHARS)
    device_types: dict[str, DeviceType] = Field(default_factory=dict)
    nodes: list[Node] = Field(min_length=1)
    network: Network = Field(default_factory=Network)

    @field_validator("device_types", mode="before")
    @classmethod
    def _name_types(cls, v: Any) -> Any:
        """Entries extend or override the catalogue: a partial override of a built-in keeps the rest."""
        if not isinstance(v, dict):
            return v
        out = {}
        for name, fields in v.items():
            if isinstance(fields, DeviceType):
                fields = fields.model_dump()
            if isinstance(fields, dict):
                base = dict(DEVICE_TYPES.get(name, {}))
                base.update(fields)
                base["name"] = name
                fields = base
            out[name] = fields
        return out

    @model_validator(mode="after")
    def _check(self) -> "Cluster":
        hosts = set()
        total = sum(n.count for n in self.nodes)
        if total > MAX_DEVICES:
            raise ValueError(f"nodes: at most {MAX_DEVICES} devices in a cluster, got {total}")
        for i, node in enumerate(self.nodes):
            if (node.host, node.device_type) in hosts:
                raise ValueError(f"nodes[{i}].host: duplicate host {node.host!r} with device_type "
                                 f"{node.device_type!r} (a host with several device types lists each type once; "
                                 f"give one entry its whole count)")
            hosts.add((node.host, node.device_type))
            if node.device_type not in self.device_types and node.device_type not in DEVICE_TYPES:
                raise ValueError(f"nodes[{i}].device_type: unknown device type {node.device_type!r}; "
                                 f"define it under device_types or use a built-in ({', '.join(DEVICE_TYPES)})")
        if isinstance(self.network.intra_node_gbps, dict):
            for t in {n.device_type for n in self.nodes}:
                if t not in self.network.intra_node_gbps:
                    raise ValueError(f"network.intra_node_gbps: no entry for device type {t!r}")
        return self

    def device_type(self, name: str) -> DeviceType:
        if name in self.device_types:
            return self.device_types[name]
        return builtin_device_type(name)

    def node(self, host: str) -> Optional[Node]:
        """The host's first entry (a host with several device types has one entry per type)."""
        entries = self._entries_by_host.get(host)
        return entries[0][1] if entries else None

    @property
    def _entries_by_host(self) -> dict[str, list[tuple[int, Node]]]:
        """host -> (first slot, entry) per entry. A host listed once per device type (a workstation with an RTX 4090
        and an RTX 3090) numbers its slots across its entries in file order: the first entry's devices are slots
        0..count-1, the next entry's follow (the order ``CUDA_VISIBLE_DEVICES`` lists them in). Why cached: a
        plan's check asks once per replica, and a wide plan has tens of thousands; kept with the node list it was
        made from, since ``model_copy(update=...)`` copies a cache along with the fields."""
        cached = self.__dict__.get("_entries_cache")
        if cached is not None and cached[0] is self.nodes:
            return cached[1]
        out: dict[str, list[tuple[int, Node]]] = {}
        for n in self.nodes:
            entries = out.setdefault(n.host, [])
            entries.append((sum(e.count for _, e in entries), n))
        self.__dict__["_entries_cache"] = (self.nodes, out)
        return out

    @property
    def hosts(self) -> list[str]:
        """Each host once, in file order."""
        return list(self._entries_by_host)

    def host_count(self, host: str) -> int:
        """Devices of ``host``, every type."""
        return sum(n.count for _, n in self._entries_by_host.get(host, ()))

    def slot_type(self, host: str, slot: int) -> Optional[str]:
        """The device type at ``host``'s ``slot`` (None: no such slot)."""
        for first, n in self._entries_by_host.get(host, ()):
            if first <= slot < first + n.count:
                return n.device_type
        return None

    def entry_slots(self) -> list[tuple[Node, range]]:
        """Every entry with the host slots it covers."""
        return [(n, range(first, first + n.count)) for entries in self._entries_by_host.values()
                for first, n in entries]

    @cached_property
    def type_names(self) -> tuple[str, ...]:
        """Device types present, in order of first appearance (cached: checked once per replica)."""
        return tuple(dict.fromkeys(n.device_type for n in self.nodes))

    def count_by_type(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.device_type] = counts.get(n.device_type, 0) + n.count
        return counts

    @property
    def num_devices(self) -> int:
        return sum(n.count for n in self.nodes)


# ---------------------------------------------------------------- model


class LayerInfo(Record):
    """One entry of the planner's ordered layer list (a measured model's layers are all of kind "layer")."""

    index: int
    kind: Literal["embedding", "block", "head", "layer"]
    name: str


MAX_MEASURED_LAYERS = 100_000
MAX_BYTES = 2 ** 62


class MeasuredLayer(Record):
    """One layer of a model described by what ``hethub profile --script`` measured on it, not by a formula:
    its class, its parameters, and per sample the bytes its backward keeps, the bytes of its input (what a
    recomputing stage keeps instead) and of its output (what crosses a stage boundary after it)."""
    name: str = Field(max_length=MAX_NAME_CHARS)
    kind: str = Field(max_length=MAX_NAME_CHARS)  # the module's class name
    params: int = Field(ge=0, le=MAX_BYTES)
    trainable_params: int = Field(ge=0, le=MAX_BYTES)
    activation_bytes: float = Field(ge=0, le=MAX_BYTES, allow_inf_nan=False)  # per sample
    input_bytes: float = Field(ge=0, le=MAX_BYTES, allow_inf_nan=False)  # per sample
    output_bytes: float = Field(ge=0, le=MAX_BYTES, allow_inf_nan=False)  # per sample


# What a measured model's transformer fields hold: nothing reads them (every price comes from its layers and
# profiles); they keep the record one shape for the code that handles both kinds.
_MEASURED_PLACEHOLDERS = {"hidden_size": 1, "num_attention_heads": 1, "ffn_hidden_size": 1, "vocab_size": 1,
                          "seq_length": 1}


class ModelConfig(Record):
    name: str = Field(default="model", max_length=MAX_NAME_CHARS)
    # gpt, llama: priced by the analytic cost model from the shape below; measured: a user's own layer list,
    # priced from what ``hethub profile --script`` measured (``measured_layers``, the profiles)
    architecture: Literal["gpt", "llama", "measured"]
    num_layers: int = Field(gt=0, le=MAX_BLOCKS)
    hidden_size: int = Field(gt=0, le=MAX_DIM)
    num_attention_heads: int = Field(gt=0, le=MAX_DIM)
    num_key_value_heads: Optional[int] = Field(default=None, gt=0, le=MAX_DIM)  # grouped-query attention
    ffn_hidden_size: int = Field(gt=0, le=MAX_DIM)
    vocab_size: int = Field(gt=0, le=MAX_DIM)
    seq_length: int = Field(gt=0, le=MAX_DIM)
    tie_embeddings: bool = False
    measured_layers: Optional[list[MeasuredLayer]] = Field(default=None, min_length=1, max_length=MAX_MEASURED_LAYERS)

    @model_validator(mode="before")
    @classmethod
    def _measured_fields(cls, data: Any) -> Any:
        """A measured model gives its layers; its transformer fields are placeholders (``num_layers``: its layer
        count), filled here and refused where given."""
        if not isinstance(data, dict) or data.get("architecture") != "measured":
            return data
        given = [k for k in (*_MEASURED_PLACEHOLDERS, "num_key_value_heads") if data.get(k) not in (None, 1)]
        if given:
            raise ValueError(f"{given[0]}: a measured model has no transformer shape (its layers are measured), "
                             f"got {str(data[given[0]])[:40]}")
        layers = data.get("measured_layers")
        count = len(layers) if isinstance(layers, list) else 0
        return {**_MEASURED_PLACEHOLDERS, **data, "num_layers": max(count, 1)}

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if (self.architecture == "measured") != (self.measured_layers is not None):
            raise ValueError("measured_layers: given exactly when architecture is 'measured' (hethub profile --script "
                             "writes such a model.json)")
        if self.measured and self.tie_embeddings:
            raise ValueError("tie_embeddings: a measured model's ties are not planned yet")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size: must be divisible by num_attention_heads={self.num_attention_heads}, "
                             f"got {self.hidden_size}")
        if self.num_key_value_heads and self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: must divide num_attention_heads={self.num_attention_heads}, "
                             f"got {self.num_key_value_heads}")
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def measured(self) -> bool:
        return self.measured_layers is not None

    def layers(self) -> list[LayerInfo]:
        """The planner's ordered layer list: embedding, one entry per transformer block, head; a measured model's
        own layers."""
        if self.measured_layers is not None:
            return [LayerInfo(index=i, kind="layer", name=f"{i}.{ml.kind}") for i, ml in enumerate(self.measured_layers)]
        out = [LayerInfo(index=0, kind="embedding", name="embedding")]
        out += [LayerInfo(index=i + 1, kind="block", name=f"block.{i}") for i in range(self.num_layers)]
        out.append(LayerInfo(index=self.num_layers + 1, kind="head", name="head"))
        return out

    @property
    def num_planner_layers(self) -> int:
        return len(self.measured_layers) if self.measured_layers is not None else self.num_layers + 2

    def shape_key(self) -> tuple:
        """What must match for a profile or checkpoint of one model to apply to another."""
        d = self.model_dump()
        d.pop("name")
        return tuple(sorted(d.items()))


def builtin_model(name: str) -> ModelConfig:
    return ModelConfig(name=name, **MODELS[name])


def load_cluster(path: str) -> Cluster:
    return parse_record(Cluster, read_data_file(path, "cluster"), "cluster")


# ---------------------------------------------------------------- profile


class LayerProfile(Record):
    index: int = Field(ge=0)
    kind: Literal["embedding", "block", "head", "layer"]
    forward_ms: float = Field(gt=0, le=MAX_RATE, allow_inf_nan=False)  # a measured time is never 0
    backward_ms: float = Field(gt=0, le=MAX_RATE, allow_inf_nan=False)
    # Bytes autograd keeps for this layer's backward at the profile's micro-batch size.
    activation_bytes: Optional[int] = Field(default=None, ge=0)
    # Peak memory of forward+backward of this layer alone (bytes); where the device reports it.
    peak_memory_bytes: Optional[int] = Field(default=None, ge=0)
    # (p90 - p10) / median of its repetitions, and how many times it was measured to get there (hethub profile).
    spread: Optional[float] = Field(default=None, ge=0, le=MAX_RATE, allow_inf_nan=False)
    rounds: int = Field(default=1, ge=1, le=100)
    # Its backward split as zb-h1 / zb-v run it: the input-gradient pass, then the weight pass (hethub profile
    # measures both where the layer's input carries a gradient). The two usually take more than backward_ms
    # together: each pass has its own fixed costs. Without them the cost model splits backward_ms analytically.
    input_grad_ms: Optional[float] = Field(default=None, gt=0, le=MAX_RATE, allow_inf_nan=False)
    weight_grad_ms: Optional[float] = Field(default=None, gt=0, le=MAX_RATE, allow_inf_nan=False)
    # Bytes the layer holds between those passes at the profile's micro-batch size: what the weight pass waits
    # with (the graph autograd keeps for weights outside plain Linears, each plain Linear's input and output
    # gradient, the gradients recorded where a weight's path joins), counted as ``activation_bytes`` is.
    weight_pass_bytes: Optional[int] = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _check_split(self) -> "LayerProfile":
        if (self.input_grad_ms is None) != (self.weight_grad_ms is None):
            given = "input_grad_ms" if self.weight_grad_ms is None else "weight_grad_ms"
            raise ValueError(f"{given}: a split backward is measured as both passes (input_grad_ms and "
                             f"weight_grad_ms), got only {given}")
        return self


class LinkProfile(Record):
    src_rank: int = Field(ge=0)
    dst_rank: int = Field(ge=0)
    op: Literal["p2p", "allreduce"]
    gbps: float = Field(gt=MIN_RATE, le=MAX_RATE, allow_inf_nan=False)  # Gbit/s
    bytes: int = Field(gt=0)


class Profile(Record):
    schema_version: int = SCHEMA_VERSION
    device_type: str = Name
    model: ModelConfig
    micro_batch_size: int = Field(gt=0, le=MAX_BATCH)
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    # Emulated slowdown factor the profile was measured under (1 = real device speed).
    emulated_slowdown: float = Field(default=1.0, ge=1, le=MAX_RATE, allow_inf_nan=False)
    # Measured in a tensor-parallel group of this many devices (blocks split, their all-reduces included).
    tensor_parallel: int = Field(default=1, gt=0, le=1024)
    layers: list[LayerProfile] = Field(default_factory=list)
    links: list[LinkProfile] = Field(default_factory=list)
    host: str = Field(default="", max_length=MAX_NAME_CHARS)

    @model_validator(mode="after")
    def _check(self) -> "Profile":
        if self.tensor_parallel > 1:
            check_tensor_parallel(self.model, self.tensor_parallel, "tensor_parallel")
        kinds = {li.index: li.kind for li in self.model.layers()}
        for i, lp in enumerate(self.layers):
            if lp.index not in kinds:
                raise ValueError(f"layers[{i}].index: model {self.model.name!r} has layers 0..{len(kinds) - 1}, "
                                 f"got {lp.index}")
            if kinds[lp.index] != lp.kind:
                raise ValueError(f"layers[{i}].kind: layer {lp.index} of model {self.model.name!r} is a "
                                 f"{kinds[lp.index]}, got {lp.kind!r}")
        return self


def load_profile(path: str) -> Profile:
    return parse_record(Profile, read_data_file(path, "profile"), f"profile {path}:")


def load_profiles(directory: str) -> list[Profile]:
    """Every ``*.json`` profile in a directory (sorted by name). Other JSON files beside them (the plan, the
    model a demo or a profile run wrote there) are not profiles and are passed over: a file is a profile when it
    names a ``device_type`` and ``layers``; one that names only one of them is a broken profile, and said so."""
    if not os.path.isdir(directory):
        raise InputError("--profiles", f"no such directory {directory!r}")
    files = sorted(f for f in os.listdir(directory) if f.endswith(".json"))
    out = []
    for f in files:
        path = os.path.join(directory, f)
        data = read_data_file(path, "profile")
        if not isinstance(data, dict) or ("device_type" not in data and "layers" not in data):
            continue  # not a profile (a plan, a model, a run's log)
        out.append(parse_record(Profile, data, f"profile {path}:"))
    if not out:
        raise InputError("--profiles", f"no profile (a *.json with device_type and layers) in {directory!r}")
    return out


# ---------------------------------------------------------------- plan


class ProfileRef(Record):
    """A profile file a plan was priced with (``partitioner.provenance``): its path relative to the plan's
    folder and its bytes' sha256."""

    path: str = Field(min_length=1, max_length=4096)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    device_type: str = Name


class Replica(Record):
    """One data-parallel replica of a stage. With the stage's ``tensor_parallel`` t > 1 it is a tensor-parallel
    group of t ranks on one host, written ``ranks``/``slots`` (``rank``/``slot`` are then its first, the lead
    that talks to neighbouring stages); without ``ranks`` the group is rank..rank+t-1 on slot..slot+t-1."""

    rank: int = Field(ge=0, lt=MAX_DEVICES)
    host: str = Name
    slot: int = Field(ge=0, lt=MAX_DEVICES)
    samples: int = Field(gt=0, le=MAX_BATCH)  # of each micro-batch
    # This replica's accelerator type when it differs from its stage's (a mixed-type stage); None: the stage's.
    device_type: Optional[str] = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    ranks: Optional[tuple[Annotated[int, Field(ge=0, lt=MAX_DEVICES)], ...]] = Field(default=None, min_length=1,
                                                                                    max_length=1024)
    slots: Optional[tuple[Annotated[int, Field(ge=0, lt=MAX_DEVICES)], ...]] = Field(default=None, min_length=1,
                                                                                    max_length=1024)

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        return check_host(v)

    @model_validator(mode="before")
    @classmethod
    def _lead_of_group(cls, data: Any) -> Any:
        """``ranks``/``slots`` imply ``rank``/``slot`` (their first), so every consumer can read the lead."""
        if isinstance(data, dict):
            data = dict(data)
            for many, one in (("ranks", "rank"), ("slots", "slot")):
                group = data.get(many)
                if isinstance(group, (list, tuple)) and group and one not in data:
                    data[one] = group[0]
        return data

    @model_serializer(mode="wrap")
    def _written(self, handler):
        """A tensor-parallel group is written with ``ranks``/``slots`` only (the contract's form)."""
        out = handler(self)
        if self.ranks is not None:
            out.pop("rank", None)
            out.pop("slot", None)
        return out

    def group_ranks(self, tensor_parallel: int) -> list[int]:
        """The replica's ranks, lead first."""
        return list(self.ranks) if self.ranks is not None else [self.rank + k for k in range(tensor_parallel)]

    def group_slots(self, tensor_parallel: int) -> list[int]:
        return list(self.slots) if self.slots is not None else [self.slot + k for k in range(tensor_parallel)]


# The pipeline schedules a plan may name (``partitioner.schedule`` writes them as action lists).
SCHEDULES = {name: k.description for name, k in KINDS.items()}  # the registry's (``schedule_kinds``)
# Schedules whose groups hold several chunks (``Stage.chunks``); the others run one chunk (``Stage.layers``).
CHUNKED = tuple(name for name, k in KINDS.items() if k.chunked)
MAX_CHUNKS = 64  # per device group


class Stage(Record):
    """One device group of the pipeline. It holds one contiguous layer range (``layers``) or, under a chunked
    schedule (``CHUNKED``), several (``chunks``, each half-open over the planner's layer list); a group written
    with one chunk reads as ``layers``, so every plan without chunks means one chunk per group."""

    index: int = Field(ge=0)
    layers: Optional[tuple[int, int]] = None  # half-open [first, last) over the planner's layer list
    chunks: Optional[tuple[tuple[int, int], ...]] = Field(default=None, min_length=1, max_length=MAX_CHUNKS)
    device_type: str = Name
    tensor_parallel: int = Field(default=1, gt=0, le=1024)
    recompute: bool = False
    # ZeRO-1 on this stage alone: its optimizer state is sharded over its replicas (the plan's memory and all-
    # reduce assume it; the runtime shards it whatever the ds_config says). Plan-wide: Plan.zero1.
    zero1: bool = False
    replicas: list[Replica] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _one_layout(cls, data: Any) -> Any:
        """``layers`` or ``chunks``, not both; one chunk is written (and read) as ``layers``."""
        if isinstance(data, dict):
            has_layers, chunks = data.get("layers") is not None, data.get("chunks")
            if has_layers and chunks is not None:
                raise ValueError("chunks: a group lists its layers or its chunks, not both")
            if not has_layers and chunks is None:
                raise ValueError("layers: a group needs its layers ([first, last)) or its chunks")
            if isinstance(chunks, (list, tuple)) and len(chunks) == 1:
                data = {**data, "layers": chunks[0]}
                data.pop("chunks")
        return data

    @property
    def chunk_ranges(self) -> tuple[tuple[int, int], ...]:
        """The group's layer ranges, in pipeline order."""
        return self.chunks if self.chunks is not None else (self.layers,)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_ranges)

    def layer_count(self) -> int:
        return sum(b - a for a, b in self.chunk_ranges)

    @property
    def width(self) -> int:
        return len(self.replicas)

    def type_of(self, replica: "Replica") -> str:
        """The accelerator type a replica runs on: its own, else the stage's."""
        return replica.device_type or self.device_type

    def degree_of(self, replica: "Replica") -> int:
        """A replica's tensor-parallel degree: ``len(ranks)``; 1 with ``rank`` alone, except in a stage where no
        replica lists ``ranks`` (then every replica is a group of the stage's ``tensor_parallel``, from ``rank``)."""
        if replica.ranks is not None:
            return len(replica.ranks)
        return self.tensor_parallel if self.uniform_tp else 1

    @cached_property
    def uniform_tp(self) -> bool:
        """Every replica has the stage's ``tensor_parallel`` (else the stage mixes degrees: per-replica TP)."""
        listed = [len(r.ranks) for r in self.replicas if r.ranks is not None]
        if len(listed) in (0, len(self.replicas)):  # the shorthand (none listed), or every group listed
            return all(n == self.tensor_parallel for n in listed)
        return self.tensor_parallel == 1 and all(n == 1 for n in listed)  # some rank-only: each of degree 1

    def ranks_of(self, replica: "Replica") -> list[int]:
        """A replica's ranks, lead first."""
        return replica.group_ranks(self.degree_of(replica))

    def slots_of(self, replica: "Replica") -> list[int]:
        return replica.group_slots(self.degree_of(replica))

    @property
    def degrees(self) -> list[int]:
        """Each replica's tensor-parallel degree, in replica order."""
        return [self.degree_of(r) for r in self.replicas]

    @property
    def device_count(self) -> int:
        return sum(self.degrees)

    @property
    def whole_state_ranks(self) -> int:
        """The ranks a stage whose replicas differ in tensor parallelism shards its ZeRO-1 state over: every rank of
        it, whole tensors (its shards do not align); 0 for a stage of one degree (sharded by replica)."""
        return 0 if self.uniform_tp else self.device_count

    @property
    def types(self) -> list[str]:
        """The stage's distinct device types, the stage's own first."""
        return list(dict.fromkeys([self.device_type] + [self.type_of(r) for r in self.replicas]))

    def sample_ranges(self) -> list[tuple[int, int]]:
        """Each replica's contiguous [start, stop) rows of every micro-batch, in replica order."""
        out, start = [], 0
        for r in self.replicas:
            out.append((start, start + r.samples))
            start += r.samples
        return out


class Chunk(NamedTuple):
    """One contiguous layer range of the pipeline (a virtual stage): its position in pipeline order, the device
    group holding it, its index among that group's chunks, and its layers [first, last)."""
    position: int
    group: int
    local: int
    first: int
    last: int


def chunk_group(schedule: str, num_groups: int, position: int) -> int:
    """The device group that holds pipeline chunk ``position`` under ``schedule`` (``ScheduleKind.chunk_group``)."""
    return kind(schedule).chunk_group(num_groups, position)


class Boundary(Record):
    """How activations and gradients cross the boundary after stage ``after_stage`` (in a plan whose groups hold
    several chunks: after pipeline chunk ``after_stage``, counted in pipeline order).

    transport: "direct" (the job's backend, e.g. NCCL/RCCL) or "host" (device -> host buffer -> gloo ->
    host -> device: the bridge between vendors whose collectives do not talk to each other).
    dtype: the wire dtype (None = the tensors' own); "fp8" is lossy (e4m3 with per-vector scales).
    """

    after_stage: int = Field(ge=0)
    transport: Literal["direct", "host"] = "direct"
    dtype: Optional[Literal["fp32", "bf16", "fp16", "fp8"]] = None


class Predicted(Record):
    model_config = ConfigDict(frozen=True, extra="allow")
    iteration_s: float
    samples_per_s: float
    upper_bound_samples_per_s: Optional[float] = None
    efficiency: Optional[float] = None
    homogeneous_sum_samples_per_s: Optional[float] = None
    # The most the same sub-clusters could reach: each plan's samples/s / (1 - its proven gap). Above the sum
    # where a time-limited sub-cluster search stopped short, so the ratio to the sum flatters the plan.
    homogeneous_sum_bound_samples_per_s: Optional[float] = None
    # Dollars per million training tokens on the devices the plan uses (None unless each has usd_per_hour).
    usd_per_million_tokens: Optional[float] = None
    stage_s: list[float] = Field(default_factory=list)
    memory_gib: list[float] = Field(default_factory=list)


class SolverInfo(Record):
    model_config = ConfigDict(frozen=True, extra="allow")
    name: str
    status: str
    gap: Optional[float] = None
    seconds: Optional[float] = None


class Plan(Record):
    schema_version: int = SCHEMA_VERSION
    model: ModelConfig
    cluster: Cluster
    global_batch_size: int = Field(gt=0, le=MAX_BATCH)
    micro_batch_size: int = Field(gt=0, le=MAX_BATCH)
    num_micro_batches: int = Field(gt=0, le=MAX_MICRO_BATCHES)
    stages: list[Stage] = Field(min_length=1, max_length=MAX_DEVICES)
    boundaries: list[Boundary] = Field(default_factory=list)
    # The plan's memory assumes ZeRO-1 (optimizer state sharded over each stage's replicas): it must run with it.
    zero1: bool = False
    # The pipeline schedule the runtime runs (partitioner.schedule): "1f1b", or "zb-h1", which splits each
    # backward into input and weight gradients so that gradients reach the previous stage sooner.
    schedule: Literal[tuple(SCHEDULES)] = "1f1b"  # type: ignore[valid-type]
    # The precision the plan was priced in and should train in (``hethub plan --dtype``, by default the
    # cheapest every device type computes natively: bf16, else fp16, else fp32); None in plans written before.
    dtype: Optional[Literal["fp32", "bf16", "fp16"]] = None
    # zb-v only: per chunk (pipeline order) its forward, input-gradient and weight-gradient pass in ms on its
    # group's slowest replica, as the planner priced them. zb-v's order comes from a list scheduler, and it orders
    # the passes by these times (absent: by layer counts, right only where every group runs at one speed); kept in
    # the plan so that the runtime, the simulator and the deadlock check derive the same order.
    chunk_pass_ms: Optional[list[tuple[PassMs, PassMs, PassMs]]] = Field(default=None, max_length=MAX_DEVICES * 4)
    predicted: Optional[Predicted] = None
    solver: Optional[SolverInfo] = None
    # The measured profiles the plan was priced with (empty: the analytic cost model).
    profiles: list[ProfileRef] = Field(default_factory=list, max_length=10_000)

    @model_validator(mode="after")
    def _check(self) -> "Plan":
        validate_plan(self)
        return self

    @property
    def world_size(self) -> int:
        return sum(s.device_count for s in self.stages)

    @property
    def num_chunks(self) -> int:
        """Chunks per device group (v; 1 unless the schedule is chunked)."""
        return self.stages[0].num_chunks

    @cached_property
    def pipeline(self) -> tuple["Chunk", ...]:
        """Every chunk in pipeline order (by first layer): the virtual stages a micro-batch passes through. Without
        chunks, chunk k is stage k."""
        found = sorted((c[0], c[1], g, j) for g, st in enumerate(self.stages) for j, c in enumerate(st.chunk_ranges))
        return tuple(Chunk(k, g, j, a, b) for k, (a, b, g, j) in enumerate(found))

    @cached_property
    def chunks_of_group(self) -> tuple[tuple[int, ...], ...]:
        """Per device group, the pipeline positions of its chunks, in order."""
        out: list[list[int]] = [[] for _ in self.stages]
        for c in self.pipeline:
            out[c.group].append(c.position)
        return tuple(tuple(x) for x in out)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def devices_by_type(self) -> dict[str, int]:
        """Devices the plan uses, per type (a tensor-parallel replica counts its whole group)."""
        out: dict[str, int] = {}
        for st in self.stages:
            for r in st.replicas:
                out[st.type_of(r)] = out.get(st.type_of(r), 0) + st.degree_of(r)
        return out

    def shards_optimizer(self, stage: "Stage") -> bool:
        """Whether a stage's optimizer state is sharded over its replicas (ZeRO-1): the plan's or the stage's own."""
        return self.zero1 or stage.zero1

    def locate(self, rank: int) -> tuple[int, int]:
        """(stage index, replica index) of a global rank."""
        return self._rank_map[rank]

    def rank_layers(self, rank: int) -> Optional[set[int]]:
        """The planner layers rank ``rank`` runs (every chunk of its group), None for a rank outside the plan."""
        if rank not in self._rank_map:
            return None
        return {i for a, b in self.stages[self.locate(rank)[0]].chunk_ranges for i in range(a, b)}

    @cached_property
    def _rank_map(self) -> dict[int, tuple[int, int]]:
        return {rank: (s.index, j) for s in self.stages for j, r in enumerate(s.replicas)
                for rank in s.ranks_of(r)}

    def boundary(self, after_stage: int) -> Optional[Boundary]:
        """The boundary after stage ``after_stage`` (None: direct, no cast)."""
        return next((b for b in self.boundaries if b.after_stage == after_stage), None)

    def idle_devices(self) -> list[tuple[str, int, str]]:
        """(host, slot, device_type) of cluster devices the plan leaves unused."""
        used = {(r.host, slot) for s in self.stages for r in s.replicas for slot in s.slots_of(r)}
        return [(n.host, k, n.device_type) for n in self.cluster.nodes for k in range(n.count)
                if (n.host, k) not in used]


def validate_plan(plan: Plan) -> None:
    """Every consumer's check of a plan's internal consistency and its fit to its own cluster.

    Raises ValueError("field: message") (wrapped by pydantic into one InputError line).
    """
    if plan.schema_version != SCHEMA_VERSION:
        raise ValueError(f"schema_version: this hethub reads version {SCHEMA_VERSION}, got {plan.schema_version}")
    if plan.micro_batch_size * plan.num_micro_batches != plan.global_batch_size:
        raise ValueError(f"global_batch_size: must equal micro_batch_size * num_micro_batches = "
                         f"{plan.micro_batch_size} * {plan.num_micro_batches} = "
                         f"{plan.micro_batch_size * plan.num_micro_batches}, got {plan.global_batch_size}")
    _check_layer_cover(plan)
    if plan.chunk_pass_ms is not None:
        _check_pass_ms(plan)
    seen_ranks: dict[int, str] = {}
    seen_slots: dict[tuple[str, int], str] = {}
    for i, st in enumerate(plan.stages):
        f = f"stages[{i}]"
        for j, r in enumerate(st.replicas):
            t, where = st.type_of(r), (f"{f}.replicas[{j}].device_type" if r.device_type else f"{f}.device_type")
            if t not in plan.cluster.type_names:
                raise ValueError(f"{where}: cluster {plan.cluster.name!r} has no {t!r} devices "
                                 f"(it has {', '.join(plan.cluster.type_names)})")
        if st.tensor_parallel > 1:
            check_tensor_parallel(plan.model, st.tensor_parallel, f"{f}.tensor_parallel")
        _check_degrees(plan, st, f)
        total = sum(r.samples for r in st.replicas)
        if total != plan.micro_batch_size:
            raise ValueError(f"{f}.replicas: samples must sum to micro_batch_size={plan.micro_batch_size}, "
                             f"got {total}")
        for j, r in enumerate(st.replicas):
            _check_replica(plan, st, r, f"{f}.replicas[{j}]", seen_ranks, seen_slots)
    _check_boundaries(plan)
    world = len(seen_ranks)
    missing = sorted(set(range(world)) - set(seen_ranks))
    if missing:
        raise ValueError(f"stages: ranks must be 0..{world - 1} without gaps, missing rank {missing[0]}")


def _check_degrees(plan: Plan, st: Stage, f: str) -> None:
    """A stage mixing tensor-parallel degrees: its ``tensor_parallel`` is the largest, and each replica's degree
    splits the model."""
    if st.uniform_tp:
        return
    degrees = st.degrees
    if max(degrees) != st.tensor_parallel:
        raise ValueError(f"{f}.tensor_parallel: a stage whose replicas differ in tensor parallelism ({'/'.join(map(str, degrees))}) "
                         f"names the largest degree, {max(degrees)}, got {st.tensor_parallel}")
    for j, (r, d) in enumerate(zip(st.replicas, degrees)):
        if d > 1:
            check_tensor_parallel(plan.model, d, f"{f}.replicas[{j}].ranks")


def check_tensor_parallel(m: "ModelConfig", t: int, field: str) -> None:
    """Megatron-style tensor parallelism splits attention heads, KV heads and the FFN width t ways."""
    for what, n in (("attention heads", m.num_attention_heads), ("KV heads", m.kv_heads),
                    ("FFN size", m.ffn_hidden_size)):
        if n % t:
            raise ValueError(f"{field}: {t} must divide the model's {what} ({n})")


def _check_layer_cover(plan: Plan) -> None:
    """Stages listed in order, each holding layers, covering the planner's layer list without gap or overlap."""
    if kind(plan.schedule).chunked or any(st.chunks is not None for st in plan.stages):
        _check_chunks(plan)
        return
    n_layers = plan.model.num_planner_layers
    expected_first = 0
    for i, st in enumerate(plan.stages):
        f = f"stages[{i}]"
        if st.index != i:
            raise ValueError(f"{f}.index: stages must be listed in order, expected {i}, got {st.index}")
        first, last = st.layers
        if first != expected_first:
            what = "gap" if first > expected_first else "overlap"
            raise ValueError(f"{f}.layers: must start at {expected_first} (the previous stage's end), "
                             f"got [{first}, {last}) ({what})")
        if last <= first:
            raise ValueError(f"{f}.layers: must hold at least one layer, got [{first}, {last})")
        if last > n_layers:
            raise ValueError(f"{f}.layers: model {plan.model.name!r} has {n_layers} planner layers "
                             f"(0..{n_layers - 1}), got [{first}, {last})")
        expected_first = last
    if expected_first != n_layers:
        raise ValueError(f"stages[{len(plan.stages) - 1}].layers: stages must cover all {n_layers} planner layers, "
                         f"last stage ends at {expected_first}")


def _check_pass_ms(plan: Plan) -> None:
    if not kind(plan.schedule).orders_by_time:
        raise ValueError(f"chunk_pass_ms: only {', '.join(n for n, k in KINDS.items() if k.orders_by_time)} orders "
                         f"its passes by time, got schedule "
                         f"{plan.schedule!r}")
    if len(plan.chunk_pass_ms) != len(plan.pipeline):
        raise ValueError(f"chunk_pass_ms: one [forward, input gradient, weight gradient] per chunk "
                         f"({len(plan.pipeline)}), got {len(plan.chunk_pass_ms)}")
    for k, times in enumerate(plan.chunk_pass_ms):
        if sum(times) <= 0:
            raise ValueError(f"chunk_pass_ms[{k}]: a chunk's passes take time, got {list(times)}")


def _check_chunks(plan: Plan) -> None:
    """A chunked plan: every group holds the same number of chunks (two under zb-v), each a non-empty layer range
    inside the model; together they cover the layer list without gap or overlap; chunk k sits on the group the
    schedule places it on (``chunk_group``)."""
    n_layers, p, v = plan.model.num_planner_layers, plan.num_stages, plan.num_chunks
    for i, st in enumerate(plan.stages):
        f = f"stages[{i}].{'chunks' if st.chunks is not None else 'layers'}"
        if st.index != i:
            raise ValueError(f"stages[{i}].index: stages must be listed in order, expected {i}, got {st.index}")
        if not kind(plan.schedule).chunked:
            raise ValueError(f"{f}: schedule {plan.schedule!r} runs one chunk per group; several need "
                             f"{' or '.join(CHUNKED)}")
        fixed = kind(plan.schedule).fixed_chunks
        if fixed is not None and st.num_chunks != fixed:
            raise ValueError(f"{f}: schedule {plan.schedule!r} gives every group {fixed} chunks, got {st.num_chunks}")
        if st.num_chunks != v:
            raise ValueError(f"{f}: every group holds the same number of chunks ({v}, as stages[0]), "
                             f"got {st.num_chunks}")
        for j, (a, b) in enumerate(st.chunk_ranges):
            where = f"{f}[{j}]" if st.chunks is not None else f
            if b <= a:
                raise ValueError(f"{where}: must hold at least one layer, got [{a}, {b})")
            if b > n_layers:
                raise ValueError(f"{where}: model {plan.model.name!r} has {n_layers} planner layers "
                                 f"(0..{n_layers - 1}), got [{a}, {b})")
    expected_first = 0
    for c in plan.pipeline:
        st = plan.stages[c.group]
        where = f"stages[{c.group}].chunks[{c.local}]" if st.chunks is not None else f"stages[{c.group}].layers"
        if c.first != expected_first:
            what = "gap" if c.first > expected_first else "overlap"
            raise ValueError(f"{where}: chunks must cover the layer list in order; chunk {c.position} must start at "
                             f"{expected_first}, got [{c.first}, {c.last}) ({what})")
        want = chunk_group(plan.schedule, p, c.position)
        if c.group != want:
            raise ValueError(f"{where}: schedule {plan.schedule!r} places chunk {c.position} (layers [{c.first}, "
                             f"{c.last})) on group {want}, not {c.group}")
        expected_first = c.last
    if expected_first != n_layers:
        raise ValueError(f"stages: chunks must cover all {n_layers} planner layers, they end at {expected_first}")


def _check_replica(plan: Plan, st: Stage, r: Replica, rf: str, seen_ranks: dict, seen_slots: dict) -> None:
    """The replica's host exists and holds the stage's type; its slots exist; slots and ranks used once."""
    cluster = plan.cluster
    if cluster.node(r.host) is None:
        raise ValueError(f"{rf}.host: cluster {cluster.name!r} has no host {r.host!r}")
    held = cluster.slot_type(r.host, r.slot)
    if held is not None and held != st.type_of(r):
        at = f" at slot {r.slot}" if len(cluster._entries_by_host[r.host]) > 1 else ""  # a host of several types
        raise ValueError(f"{rf}.host: {r.host!r} holds {held}{at}, but the replica runs on {st.type_of(r)}")
    t = st.degree_of(r)
    for many, one in (("ranks", "rank"), ("slots", "slot")):
        group = getattr(r, many)
        if group is None:
            continue
        if len(group) != t:  # slots against ranks (ranks make the degree)
            raise ValueError(f"{rf}.{many}: a replica of {t} rank(s) lists {t} {many}, got {len(group)}")
        if getattr(r, one) != group[0]:
            raise ValueError(f"{rf}.{one}: must be the first of {many} ({group[0]}), got {getattr(r, one)}")
    slots = r.group_slots(t)
    count = cluster.host_count(r.host)
    if max(slots) >= count:
        raise ValueError(f"{rf}.slot{'s' if r.slots is not None else ''}: host {r.host!r} has slots "
                         f"0..{count - 1}, got {max(slots)}"
                         + (f" (+{t - 1} for tensor parallel)" if t > 1 and r.slots is None else ""))
    other = next((s for s in slots if cluster.slot_type(r.host, s) != st.type_of(r)), None)
    if other is not None:
        raise ValueError(f"{rf}.slots: {r.host}:{other} holds {cluster.slot_type(r.host, other)}, but the replica "
                         f"runs on {st.type_of(r)}")
    for slot, rank in zip(slots, r.group_ranks(t)):
        key = (r.host, slot)
        if key in seen_slots:
            raise ValueError(f"{rf}.slot: {r.host}:{slot} is already used by {seen_slots[key]}")
        seen_slots[key] = rf
        if rank in seen_ranks:
            raise ValueError(f"{rf}.rank: rank {rank} is already used by {seen_ranks[rank]}")
        seen_ranks[rank] = rf


def _check_boundaries(plan: Plan) -> None:
    """A boundary follows a chunk of the pipeline (with one chunk per group: a stage), never the last."""
    seen = set()
    last = len(plan.pipeline) - 2
    for k, bd in enumerate(plan.boundaries):
        if bd.after_stage > last:
            raise ValueError(f"boundaries[{k}].after_stage: the last boundary is after "
                             f"{'chunk' if plan.num_chunks > 1 else 'stage'} {last}, got {bd.after_stage}")
        if bd.after_stage in seen:
            raise ValueError(f"boundaries[{k}].after_stage: boundary after stage {bd.after_stage} is listed twice")
        seen.add(bd.after_stage)


def load_plan(path: str) -> Plan:
    return parse_record(Plan, read_data_file(path, "plan"), "plan")
