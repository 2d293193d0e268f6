"""Every config group and every documented CLI example composes; typos and wrong types are rejected by name."""

import itertools
from pathlib import Path

import pytest
from mobilenet.config import CONF_DIR, VALUE_RULES, Config, compose
from mobilenet.errors import ConfigError

GROUPS = ["backend", "norm", "data", "model", "optim", "experiment"]
README = Path(__file__).resolve().parent.parent / "README.md"

README_EXAMPLES = [
    [],
    ["backend=custom", "amp=true"],
    ["backend=cudnn", "amp=true", "amp_dtype=bf16", "channels_last=true", "data=folder", "data.root=/data/imagenet"],
    ["data=synthetic", "backend=cudnn", "amp=true", "channels_last=true"],
    ["data=synthetic", "backend=custom", "amp=true", "channels_last=true"],
    ["experiment=benchmark", "compile=true", "device=cuda"],
    ["optim=rmsprop", "model.width_mult=0.5"],
    ["model.width_mult=0.5", "epochs=3"],
    ["data=dali", "data.root=/data/imagenet", "backend=custom", "amp=true", "channels_last=true"],
]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("group, option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes(group, option):
    cfg = compose([f"{group}={option}"])
    if group != "experiment":
        assert cfg[group] is not None


@pytest.mark.parametrize("overrides", README_EXAMPLES, ids=lambda o: " ".join(o) or "default")
def test_every_cli_example_composes(overrides):
    cfg = compose(overrides)
    for item in overrides:
        key, value = item.split("=", 1)
        if key not in GROUPS:
            assert str(_get(cfg, key)).lower().endswith(value.lower()), key


def test_multirun_example_composes_every_combination():
    # python train.py -m backend=torch,cudnn amp=false,true
    for backend, amp in itertools.product(["torch", "cudnn"], ["false", "true"]):
        cfg = compose([f"backend={backend}", f"amp={amp}"])
        assert cfg.backend.name == backend and cfg.amp == (amp == "true")


def test_default_is_the_embedded_digits_job():
    cfg = compose([])
    assert (cfg.data.name, cfg.data.builtin, cfg.backend.name, cfg.amp, cfg.device.value) == ("folder", "digits", "torch", False, "auto")


@pytest.mark.parametrize("override, key", [
    ("data.batchsize=3", "batchsize"),
    ("data.batch_size=many", "batch_size"),
    ("amp=perhaps", "amp"),
    ("amp_dtype=fp8", "amp_dtype"),
    ("device=tpu", "device"),
    ("optim.name=adam", "name"),
    ("chanels_last=true", "chanels_last"),
])
def test_typos_and_wrong_types_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        compose([override])
    assert key in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("group", ["backend", "data", "optim", "model"])
def test_unknown_group_option_lists_the_choices(group):
    with pytest.raises(ConfigError) as err:
        compose([f"{group}=nonexistent"])
    text = str(err.value)
    assert text.startswith(f"no config '{group}/nonexistent'; choose one of: ")
    for option in options(group):
        assert option in text


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = cfg[part]
    return getattr(cfg, "value", cfg)


def test_infer_run_names_leave_out_the_same_keys_as_train(tmp_path):
    from omegaconf import OmegaConf

    import infer
    from mobilenet.config import unnamed_keys

    yaml_keys = OmegaConf.load(Path(__file__).resolve().parent.parent / "conf" / "config.yaml").hydra.job.config.override_dirname.exclude_keys
    assert unnamed_keys() == set(yaml_keys)
    # infer.py's run directory: log_root and device stay out of the name, what is measured stays in
    root = tmp_path / "logs"
    infer.main(["--profile", "--steps", "2", "--warmup", "1", "backend=torch", "device=cpu", "data.batch_size=2",
                "data.resolution=32", "model.width_mult=0.25", f"log_root={root}"])
    names = [p.name for p in (root / "infer").iterdir()]
    assert names == ["data-synthetic+backend-torch+data.batch_size-2+data.resolution-32+model.width_mult-0.25"], names


def readme_commands() -> list[list[str]]:
    """The Hydra overrides of every `python train.py` / `python infer.py` line in the README's code blocks: flags
    (and the values they take) dropped, `-m` grids reduced to their first combination."""
    import re
    import shlex

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.splitlines():
            words = shlex.split(line.split("#", 1)[0])
            for script in ("train.py", "infer.py"):
                if script in words:
                    args = words[words.index(script) + 1:]
                    overrides, skip = [], False
                    for a in args:
                        if skip:
                            skip = False
                        elif a.startswith("-"):
                            skip = a in ("--checkpoint", "--images", "--export", "--batch-sizes", "--steps", "--warmup")
                        elif "=" in a:
                            key, value = a.split("=", 1)
                            overrides.append(f"{key}={value.split(',')[0]}")
                    commands.append(overrides)
    return commands


def test_the_readme_shows_commands_and_every_one_composes():
    commands = readme_commands()
    assert len(commands) >= 10
    for overrides in commands:
        compose(overrides)



def test_every_value_rule_names_a_key_of_the_schema():
    # check_values reads a missing key as null and passes it: a renamed setting must not leave its rule checking nothing
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(Config)
    for key, _, _ in VALUE_RULES:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(schema, parent) if parent else schema
        assert OmegaConf.is_dict(node) and leaf in node, key


@pytest.mark.parametrize("override, message", [
    ("optim.lr=-0.1", "optim.lr=-0.1: must be a number >= 0"),
    ("optim.momentum=1", "optim.momentum=1.0: must be a number in [0, 1)"),
    ("optim.weight_decay=-1e-5", "optim.weight_decay=-1e-05: must be a number >= 0"),
    ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio=1.5: must be a number in [0, 1]"),
    ("optim.label_smoothing=1", "optim.label_smoothing=1.0: must be a number in [0, 1)"),
    ("optim.eps=0", "optim.eps=0.0: must be a number > 0"),
    ("model.dropout=1", "model.dropout=1.0: must be a probability in [0, 1)"),
    ("data.crop_scale=[0.5,0.1]", "data.crop_scale=[0.5, 0.1]: must be [min, max] shares"),
    ("data.crop_scale=[0.5]", "data.crop_scale=[0.5]: must be [min, max] shares"),
    ("data.val_resize_ratio=0", "data.val_resize_ratio=0.0: must be a number in (0, 1]"),
    ("data.std=[0.2,0,0.2]", "data.std=[0.2, 0.0, 0.2]: must be three numbers > 0"),
    ("data.steps_per_epoch=0", "data.steps_per_epoch=0: must be a whole number >= 1, or null"),
    ("data.val_steps=-1", "data.val_steps=-1: must be a whole number >= 1, or null"),
    ("data.dali.prefetch=0", "data.dali.prefetch=0: must be a whole number >= 1"),
    ("perf.log_every=0", "perf.log_every=0: must be a whole number of steps >= 1"),
    ("perf.warmup_steps=-1", "perf.warmup_steps=-1: must be a whole number of untimed steps >= 0"),
    ("profiler.active=0", "profiler.active=0: must be a whole number of steps >= 1"),
])
def test_a_setting_outside_its_values_is_refused_naming_what_is_allowed(override, message):
    with pytest.raises(ConfigError) as err:
        compose([override])
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize("override", ["optim.lr=0", "optim.momentum=0", "optim.weight_decay=0", "model.dropout=0",
                                      "data.crop_scale=[1,1]", "data.val_resize_ratio=1", "perf.warmup_steps=0",
                                      "data.workers=0", "data.steps_per_epoch=null", "optim.min_lr_ratio=1",
                                      "optim.warmup_epochs=0", "perf.single_gpu_img_s=null"])
def test_the_bounds_of_the_allowed_values_compose(override):
    import yaml
    from omegaconf import OmegaConf

    key, value = override.split("=", 1)
    assert OmegaConf.select(compose([override]), key) == yaml.safe_load(value)
