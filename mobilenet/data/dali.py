"""data=dali: NVIDIA DALI pipelines over the same ImageFolder layout (and labels) as data=folder.

Train: file reader (sharded, shuffled) -> JPEG decode fused with a random-resized crop (nvJPEG on the GPU with
data.dali.decode=mixed, libjpeg-turbo with decode=cpu) -> resize to data.resolution -> optional random flip ->
normalise and cast in one `crop_mirror_normalize`. Val: decode -> shorter side to resolution/val_resize_ratio ->
centre crop -> normalise. Without a GPU (spec.device is the CPU) the same pipelines run with CPU operators.

Memory format: with channels_last the pipeline writes HWC and the NHWC batch is handed over as
`permute(0, 3, 1, 2)`, a channels_last NCHW *view* of the same memory (no copy); otherwise it writes CHW.

Buffer lifetime: DALI 2.x's dynamic executor (exec_dynamic=True, asked for explicitly rather than taken from a
default) allocates its outputs per iteration and reference-counts them, and DALIGenericIterator hands them to
PyTorch by DLPack (no copy, ordered after DALI's work on the consumer's current stream). A yielded tensor keeps its
DALI buffer alive for as long as it is referenced, so DALI never overwrites a batch the training step is still
using. When PyTorch frees it, DALI takes the buffer back after a cudaDeviceSynchronize in a thread of its own (its
"DLTensorGraveyard"). The alternative, the legacy executor copying each batch into PyTorch's memory, is slower
(docs/results/loader_h200.md), so it is not offered.

bf16: DALI has no bfloat16 type. For a bf16 run the pipeline produces float32 and each batch is converted on the
device (one extra elementwise copy per batch); this is logged as a warning when the loader is built.

Several training pipelines (data.dali.pipelines=N): a pipeline's decoder works through one batch at a time, and
between two batches, while the host parses the next batch's headers and sets up its decode, the GPU's JPEG engines
wait. N pipelines, each with its own reader shard (rank r's pipeline k reads shard r*N+k of world*N), decoder and
threads, keep them fed from several batches at once; the loader takes the pipelines' batches in turn. Every image
still comes once per epoch: the world*N shards are disjoint and rotate together. Unset, N is 2 with decode=mixed
(the hardware decoder's engines) and 1 with decode=cpu.

Corrupt files: DALI's decoder errors do not name the file (they read e.g. "nvImageCodec failure: '#3'") and leave
the pipeline unusable. So the file list is checked up front (data.dali.check_files, on by default): the image's
signature, for JPEG the marker structure up to the scan (a frame header with a size) and the end-of-image marker
that a truncated file lacks. A bad file is a CorruptImageError naming it, or, with data.skip_corrupt=true, left
out of the list and counted (`loader.skipped`) and logged. The check costs about 20 us per file with a warm page
cache (ImageNet's 1.28M files: about half a minute); data.dali.check_files=false skips it, and then a DALI failure
runs the same check on the loader's files to name the culprit before the error is raised.
"""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ..config import enum_value
from ..errors import ConfigError
from . import LoaderSpec, register_loader
from .folder import CorruptImageError, available_cpus, check_batch_fits, scan_image_folder, val_resize_size

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "data=dali needs NVIDIA DALI, which is not installed in this Python environment. Install the wheel that matches "
    "your CUDA driver: `pip install nvidia-dali-cuda130` (CUDA 13) or `pip install nvidia-dali-cuda120` (CUDA 12) "
    "(see https://docs.nvidia.com/deeplearning/dali/user-guide/docs/installation.html), or choose another loader "
    "explicitly (data=folder). data=dali does not fall back to another loader."
)

# Encoded images the reader holds for its shuffle; DALI also shuffles the whole list once up front (with a seed
# shared by all shards), so a class-sorted ImageFolder list is mixed globally before sharding.
SHUFFLE_BUFFER = 4096
# Preallocated nvJPEG memory (bytes) so that the first large images do not trigger reallocation (and a stall).
NVJPEG_DEVICE_PADDING = 211_025_920
NVJPEG_HOST_PADDING = 140_544_512
# torchvision's RandomResizedCrop aspect-ratio range.
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)


def import_dali():
    """(fn, types, pipeline_def, DALIGenericIterator, LastBatchPolicy) or an ImportError that says how to install."""
    try:
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} (import error: {e})") from e
    return fn, types, pipeline_def, DALIGenericIterator, LastBatchPolicy


# ---------------------------------------------------------------------------------------------- file checks

# JPEG markers that carry the frame size (SOF0..SOF15 except DHT C4, JPG C8, DAC CC).
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers without a length field: TEM and RST0..7 (SOI/EOI are handled explicitly).
_STANDALONE_MARKERS = frozenset([0x01, *range(0xD0, 0xD8)])
# One read covers the header of almost every JPEG (EXIF blocks can make it longer: then we read on).
_HEAD_BYTES = 8192
# How far from the end the end-of-image marker may sit (some writers append padding or metadata after it).
_TAIL_BYTES = 4096


def _check_jpeg(fd: int, head: bytes, size: int) -> str | None:
    """Walk the markers from SOI to the start of scan (a frame header with a size on the way), then look for EOI."""
    data, base = head, 0  # data holds the file's bytes from offset `base`
    pos = 2
    frame_seen = False
    while True:
        if pos + 4 > base + len(data):  # the header runs past what we read: read on from `pos`
            if pos >= size:
                return "truncated JPEG header (no image data)"
            data, base = os.pread(fd, _HEAD_BYTES, pos), pos
            if len(data) < 4:
                return "truncated JPEG header"
        i = pos - base
        if data[i] != 0xFF:
            return f"bad JPEG marker structure at byte {pos}"
        code = data[i + 1]
        if code == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if code in _STANDALONE_MARKERS:
            pos += 2
            continue
        if code == 0xD9:
            return "JPEG ends before its image data (end-of-image marker in the header)"
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if length < 2:
            return f"bad JPEG segment length {length} at byte {pos}"
        if code in _SOF_MARKERS:
            if pos + 10 > base + len(data):
                data, base, i = os.pread(fd, _HEAD_BYTES, pos), pos, 0
            frame = data[i + 4:i + 10]
            if len(frame) < 6:
                return "truncated JPEG frame header"
            height, width, components = int.from_bytes(frame[1:3], "big"), int.from_bytes(frame[3:5], "big"), frame[5]
            if height == 0 or width == 0 or components not in (1, 3, 4):
                return f"unsupported JPEG frame ({width}x{height}, {components} components)"
            frame_seen = True
        elif code == 0xDA:  # start of scan: the header is complete
            if not frame_seen:
                return "JPEG scan without a frame header"
            break
        pos += 2 + length
    # In entropy-coded data every 0xFF is followed by 0x00 or a restart marker, so FF D9 after the scan starts is
    # the end-of-image marker. Usually it is in the last few bytes; a file with a long trailer after it (some
    # cameras append data) costs one full read of its image data, as does a truncated file.
    tail = head[-_TAIL_BYTES:] if size <= len(head) else os.pread(fd, _TAIL_BYTES, max(0, size - _TAIL_BYTES))
    if b"\xff\xd9" in tail[max(0, pos - (size - len(tail))):]:
        return None
    if size > len(head) and b"\xff\xd9" in os.pread(fd, size - pos, pos):
        return None
    return "truncated JPEG (no end-of-image marker)"


def check_image_file(path: str) -> str | None:
    """Why DALI could not decode `path` (a cheap check of signature and structure), or None if it looks fine."""
    try:
        fd = os.open(path, os.O_RDONLY)  # raw reads: a buffered file object would double the cost per file
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, _HEAD_BYTES, 0)
            if head.startswith(b"\xff\xd8\xff"):
                return _check_jpeg(fd, head, size)
            if head.startswith(b"\x89PNG\r\n\x1a\n"):
                return None if b"IEND" in os.pread(fd, 64, max(0, size - 64)) else "truncated PNG (no IEND chunk)"
        finally:
            os.close(fd)
    except OSError as e:
        return f"cannot read it ({e})"
    if (head[:2] == b"BM" or head[:4] in (b"II*\x00", b"MM\x00*") or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")
            or (head[:1] == b"P" and head[1:2] in b"123456" and len(head) > 2)):
        return None
    if not head:
        return "empty file"
    return f"not a JPEG or other image DALI can decode (starts with {head[:8]!r})"


def find_corrupt(paths: list[str], threads: int) -> list[tuple[str, str]]:
    """[(path, reason)] for the files that fail `check_image_file`, in list order."""
    # Chunks, not one task per file: per-task overhead would exceed the check. Threads overlap cold-cache reads.
    chunks = [paths[i:i + 1024] for i in range(0, len(paths), 1024)]
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        reasons = [r for chunk in pool.map(lambda c: [check_image_file(p) for p in c], chunks) for r in chunk]
    return [(p, r) for p, r in zip(paths, reasons) if r is not None]


def drop_corrupt(samples: list[tuple[str, int]], skip_corrupt: bool, threads: int, split: str) -> tuple[list[tuple[str, int]], int]:
    """(samples without corrupt files, how many were dropped); a CorruptImageError naming the file unless skipping."""
    bad = find_corrupt([p for p, _ in samples], threads)
    if not bad:
        return samples, 0
    if not skip_corrupt:
        path, reason = bad[0]
        more = f" ({len(bad) - 1} more corrupt file(s) in {split}/, e.g. {bad[1][0]!r})" if len(bad) > 1 else ""
        raise CorruptImageError(f"cannot decode image {path!r}: {reason}{more}. Fix or remove it, or set data.skip_corrupt=true")
    bad_paths = {p for p, _ in bad}
    shown = ", ".join(f"{p!r} ({r})" for p, r in bad[:3])
    log.warning("data=dali %s: skipped %d corrupt image(s) (data.skip_corrupt=true), e.g. %s", split, len(bad), shown)
    return [s for s in samples if s[0] not in bad_paths], len(bad)


# ------------------------------------------------------------------------------------------------ pipelines


def _normalize_args(cfg, out_type, channels_last: bool) -> dict:
    return dict(
        dtype=out_type,
        output_layout="HWC" if channels_last else "CHW",
        mean=[m * 255.0 for m in cfg.mean],
        std=[s * 255.0 for s in cfg.std],
    )


def decoder_args(cfg, decode: str) -> dict:
    """The GPU decoder's settings (memory padding, hardware share) for `decode`; none for the CPU decoder."""
    if decode != "mixed":
        return {}
    return dict(device_memory_padding=NVJPEG_DEVICE_PADDING, host_memory_padding=NVJPEG_HOST_PADDING,
                hw_decoder_load=float(cfg.dali.hw_decoder_load))


def random_crop_args(cfg) -> dict:
    """The random-resized crop's window, as torchvision's RandomResizedCrop draws it (area, aspect ratio, attempts)."""
    return dict(random_area=list(cfg.crop_scale), random_aspect_ratio=list(CROP_RATIO), num_attempts=10)


def make_train_pipeline(cfg, files, labels, *, decode: str, on_gpu: bool, out_type, channels_last: bool,
                        shard_id: int, num_shards: int, **pipeline_kwargs):
    """The training pipeline: `files` with `labels`, this rank's shard of them, shuffled and augmented."""
    fn, types, pipeline_def, _, _ = import_dali()
    res = cfg.resolution
    initial_fill = max(1, min(SHUFFLE_BUFFER, len(files) // max(1, num_shards)))
    decoder_extra = decoder_args(cfg, decode)

    @pipeline_def(exec_dynamic=True)
    def train_pipe():
        # pad_last_batch: each epoch ends at the shard's end (the padded last batch is dropped) instead of running
        # into the next epoch's samples, which would repeat images within one epoch.
        jpegs, lbl = fn.readers.file(files=files, labels=labels, random_shuffle=True, initial_fill=initial_fill,
                                     shard_id=shard_id, num_shards=num_shards, pad_last_batch=True, name="Reader")
        images = fn.decoders.image_random_crop(jpegs, device=decode, output_type=types.RGB, **random_crop_args(cfg),
                                               **decoder_extra)
        if on_gpu and decode == "cpu":
            images = images.gpu()  # only the decode runs on the host; resize and normalise stay on the GPU
        images = fn.resize(images, resize_x=res, resize_y=res, interp_type=types.INTERP_LINEAR, antialias=True)
        mirror = fn.random.coin_flip(probability=0.5) if cfg.hflip else 0
        images = fn.crop_mirror_normalize(images, mirror=mirror, **_normalize_args(cfg, out_type, channels_last))
        lbl = fn.cast(lbl, dtype=types.INT64)
        if on_gpu:
            lbl = lbl.gpu()
        return images, lbl

    return train_pipe(**pipeline_kwargs)


def make_val_pipeline(cfg, files, labels, *, decode: str, on_gpu: bool, out_type, channels_last: bool,
                      **pipeline_kwargs):
    """The validation pipeline over this rank's own file list (no DALI sharding, last batch padded then trimmed)."""
    fn, types, pipeline_def, _, _ = import_dali()
    res = cfg.resolution
    decoder_extra = decoder_args(cfg, decode)

    @pipeline_def(exec_dynamic=True)
    def val_pipe():
        jpegs, lbl = fn.readers.file(files=files, labels=labels, random_shuffle=False, pad_last_batch=True, name="Reader")
        images = fn.decoders.image(jpegs, device=decode, output_type=types.RGB, **decoder_extra)
        if on_gpu and decode == "cpu":
            images = images.gpu()
        images = fn.resize(images, resize_shorter=val_resize_size(cfg), interp_type=types.INTERP_LINEAR, antialias=True)
        images = fn.crop_mirror_normalize(images, crop=(res, res), crop_pos_x=0.5, crop_pos_y=0.5,
                                          **_normalize_args(cfg, out_type, channels_last))
        lbl = fn.cast(lbl, dtype=types.INT64)
        if on_gpu:
            lbl = lbl.gpu()
        return images, lbl

    return val_pipe(**pipeline_kwargs)


# -------------------------------------------------------------------------------------------------- loader


class DaliLoader:
    """Loader protocol over DALIGenericIterators, one per pipeline (several only in training, taken in turn); see
    the module docstring for layout, buffer lifetime and pipelines."""

    def __init__(self, pipelines: list, files: list[str], *, train: bool, spec: LoaderSpec, batch_size: int,
                 num_classes: int, num_batches: int, num_samples: int, skipped: int, name: str):
        _, _, _, DALIGenericIterator, LastBatchPolicy = import_dali()
        self.spec = spec
        self.train = train
        self.batch_size = batch_size
        self.num_classes = num_classes
        self.num_samples = num_samples
        self.skipped = skipped  # corrupt files left out of the list (data.skip_corrupt=true)
        self.classes: list[str] | None = None
        self.name = name
        self._files = files  # to name a file DALI failed on
        self._num_batches = num_batches
        self._convert_to = torch.bfloat16 if spec.dtype == torch.bfloat16 else None
        if len(pipelines) > 1 and not train:
            raise ValueError("a validation loader reads its images in order, with one pipeline")
        # Train drops the last partial batch; val returns it partial with DALI's padding removed.
        policy = LastBatchPolicy.DROP if train else LastBatchPolicy.PARTIAL
        self._iterators = [DALIGenericIterator([p], ["images", "labels"], reader_name="Reader", last_batch_policy=policy,
                                               auto_reset=True, prepare_first_batch=False) for p in pipelines]
        self._turn = 0  # the pipeline whose batch comes next; kept across epochs so that capped epochs stay balanced
        self._epoch_finished = True

    def __len__(self) -> int:
        return self._num_batches

    def set_epoch(self, epoch: int) -> None:
        pass  # DALI reshuffles (train) and rotates shards by itself every epoch

    def _handover(self, out: dict) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = out["images"], out["labels"]
        if self.spec.channels_last:
            images = images.permute(0, 3, 1, 2)  # NHWC memory seen as channels_last NCHW: a view, no copy
        if self._convert_to is not None:
            images = images.to(self._convert_to)  # keeps the memory format
        return images, labels.view(-1)

    @property
    def pipelines(self) -> int:
        return len(self._iterators)

    def _next(self, iterator):
        try:
            return next(iterator)[0]
        except RuntimeError as e:
            # DALI's message does not name the file: look for it now (cheap check), then say what we know.
            bad = find_corrupt(self._files, min(32, available_cpus()))
            if bad:
                path, reason = bad[0]
                raise CorruptImageError(f"cannot decode image {path!r}: {reason} (DALI stopped: {e}). "
                                        "Fix or remove it, or set data.skip_corrupt=true") from e
            raise RuntimeError(
                f"DALI failed while loading {self.name} data: {e}\nDALI's decoder errors do not name the file, and "
                "every file passes the cheap check of signature and JPEG structure; decoding the ImageFolder with "
                "data=folder names the file that fails."
            ) from e

    def __iter__(self):
        if not self._iterators:
            return
        if self.train:
            for _ in range(self._num_batches):
                iterator = self._iterators[self._turn]
                self._turn = (self._turn + 1) % len(self._iterators)
                try:
                    out = self._next(iterator)
                except StopIteration:  # DALI's epoch ended (auto_reset started the next): capped epochs run across
                    out = self._next(iterator)
                yield self._handover(out)
            return
        (iterator,) = self._iterators
        # Validation must start at the first image every time: finish an epoch that a consumer abandoned.
        if not self._epoch_finished:
            for _ in iterator:
                pass
        self._epoch_finished = False
        while True:
            try:
                out = self._next(iterator)
            except StopIteration:
                self._epoch_finished = True
                return
            yield self._handover(out)


def _output_type(spec: LoaderSpec, types):
    if spec.dtype == torch.float16:
        return types.FLOAT16
    if spec.dtype == torch.float32:
        return types.FLOAT
    if spec.dtype == torch.bfloat16:
        log.warning("data=dali: DALI cannot output bfloat16; the pipeline produces float32 and every batch is converted "
                    "to bfloat16 on %s (one extra copy per batch). Use fp16 or fp32 to avoid it.", spec.device)
        return types.FLOAT
    raise ValueError(f"data=dali produces float16, float32 or (via float32) bfloat16 images, not {spec.dtype}")


def check_decoder_load(dali_cfg) -> None:
    """A clear error for a hardware-decoder share outside 0..1 (DALI's own message does not name the setting)."""
    hw = float(dali_cfg.hw_decoder_load)
    if not 0.0 <= hw <= 1.0:
        raise ConfigError(f"data.dali.hw_decoder_load={hw:g} is the share of JPEGs sent to the GPU's hardware decoder: "
                          "a number from 0 to 1 (1.0, the default: all of them)")


DEFAULT_MIXED_PIPELINES = 2  # measured: docs/results/loader_h100_9cfeb02.md


def check_pipelines(dali_cfg) -> int:
    """data.dali.pipelines as a count (the default's for its decoder where it is unset), or a clear error."""
    n = dali_cfg.pipelines  # an int or None: the structured config refuses anything else when it composes
    if n is None:
        return DEFAULT_MIXED_PIPELINES if enum_value(dali_cfg.decode) == "mixed" else 1
    if n < 1:
        raise ConfigError(f"data.dali.pipelines={n!r} is the number of training pipelines decoding side by side: a whole "
                          f"number from 1 (unset: {DEFAULT_MIXED_PIPELINES} with decode=mixed, 1 with decode=cpu)")
    return n


def decoder_label(dali_cfg) -> str:
    """How a data=dali run decodes, for its summary and log."""
    decode = enum_value(dali_cfg.decode)
    label = f"decode={decode}, {dali_cfg.threads} thread(s), prefetch {dali_cfg.prefetch}"
    if decode == "mixed":
        label += f", hw_decoder_load {float(dali_cfg.hw_decoder_load):g}"
    pipelines = check_pipelines(dali_cfg)
    if pipelines > 1:
        label += f", {pipelines} training pipelines of {dali_cfg.threads} thread(s) each"
    return label


def _device_id(spec: LoaderSpec) -> int | None:
    if spec.device.type == "cpu":
        return None
    if spec.device.type != "cuda":
        raise ValueError(f"data=dali runs on a CUDA GPU or the CPU, not on {spec.device}")
    return spec.device.index if spec.device.index is not None else torch.cuda.current_device()


@register_loader("dali")
def build(cfg, spec: LoaderSpec):
    _, types, _, _, _ = import_dali()  # before anything else: a missing DALI is the error to report
    dali_cfg = cfg.dali
    check_decoder_load(dali_cfg)
    n_pipes = check_pipelines(dali_cfg)
    _, train_samples, val_samples, classes = scan_image_folder(cfg)
    skipped = {"train": 0, "val": 0}
    if dali_cfg.check_files:
        check_threads = max(dali_cfg.threads, min(32, available_cpus()))
        train_samples, skipped["train"] = drop_corrupt(train_samples, cfg.skip_corrupt, check_threads, "train")
        val_samples, skipped["val"] = drop_corrupt(val_samples, cfg.skip_corrupt, check_threads, "val")
    elif cfg.skip_corrupt:
        raise ValueError("data.skip_corrupt=true needs data.dali.check_files=true: DALI cannot skip a file it fails to decode")
    check_batch_fits(len(train_samples), cfg, spec.world_size)

    device_id = _device_id(spec)
    on_gpu = device_id is not None
    decode = enum_value(dali_cfg.decode)
    if not on_gpu and decode != "cpu":
        raise ValueError(f"data.dali.decode={decode} decodes on the GPU, but this run has none; "
                         "set data.dali.decode=cpu for DALI's CPU-only mode")
    out_type = _output_type(spec, types)
    common = dict(decode=decode, on_gpu=on_gpu, out_type=out_type, channels_last=spec.channels_last,
                  batch_size=cfg.batch_size, num_threads=dali_cfg.threads, device_id=device_id,
                  prefetch_queue_depth=dali_cfg.prefetch)
    # One seed per run and rank: ranks augment differently, and data.dali.seed / the run's seed both change it.
    seed = (dali_cfg.seed + 1000 * spec.seed + spec.rank) % (2**31)

    # Train: DALI shards (shard i holds images [N*i/S, N*(i+1)/S) of its globally shuffled list, and the shards
    # rotate every epoch); every rank yields the same number of full batches, as DDP needs: the iterator sizes an
    # epoch as floor(N/S) images and drops the partial batch. With P pipelines a rank's pipeline k reads shard
    # rank*P+k of world*P.
    train_files = [p for p, _ in train_samples]
    train_labels = [lbl for _, lbl in train_samples]
    shards = spec.world_size * n_pipes
    train_batches = n_pipes * ((len(train_files) // shards) // cfg.batch_size)
    if train_batches == 0:
        setting = (f"data.dali.pipelines={n_pipes}" if dali_cfg.pipelines is not None else
                   f"data.dali.pipelines (unset: {n_pipes} with decode={decode})")
        raise ConfigError(f"{setting}: each of the {shards} shard(s) of the {len(train_files)} training images holds "
                          f"less than one batch of {cfg.batch_size}; use fewer pipelines (data.dali.pipelines=1)")
    if cfg.steps_per_epoch is not None:
        train_batches = min(train_batches, cfg.steps_per_epoch)
    # Each pipeline its own augmentation seed, apart from the ranks' (seed + rank) and from validation's.
    train_pipes = [make_train_pipeline(cfg, train_files, train_labels, shard_id=spec.rank * n_pipes + k, num_shards=shards,
                                       seed=(seed + 104_729 * k) % (2**31), **common) for k in range(n_pipes)]
    train = DaliLoader(train_pipes, train_files, train=True, spec=spec, batch_size=cfg.batch_size, num_classes=len(classes),
                       num_batches=train_batches, num_samples=train_batches * cfg.batch_size,
                       skipped=skipped["train"], name="train")

    # Val: the folder loader's strided shard (rank, rank+S, ...), no padding, so each image counts exactly once
    # overall; a val_steps cap shortens the list itself, so every evaluation sees the same images.
    val_rank = val_samples[spec.rank::spec.world_size]
    if cfg.val_steps is not None:
        val_rank = val_rank[: cfg.val_steps * cfg.batch_size]
    val_files = [p for p, _ in val_rank]
    val_labels = [lbl for _, lbl in val_rank]
    val_pipes = [make_val_pipeline(cfg, val_files, val_labels, seed=seed + 7919, **common)] if val_rank else []
    val = DaliLoader(val_pipes, val_files, train=False, spec=spec, batch_size=cfg.batch_size, num_classes=len(classes),
                     num_batches=math.ceil(len(val_rank) / cfg.batch_size), num_samples=len(val_rank),
                     skipped=skipped["val"], name="val")
    train.classes = val.classes = classes  # class names, as data=folder provides them
    log.info("data=dali: %s on %s, %d train / %d val image(s) on rank %d of %d", decoder_label(dali_cfg),
             spec.device, train.num_samples, val.num_samples, spec.rank, spec.world_size)
    return train, val
