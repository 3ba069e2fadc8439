"""PatchFastRL rebinds trl's names to slimrl's subclasses, is idempotent, undoable and version-gated."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import trl

import slimrl
from slimrl import patching
from slimrl.trainers.common.trl_originals import trl_original


@pytest.fixture(autouse=True)
def _restore_trl():
    yield
    slimrl.unpatch()


def test_import_slimrl_does_not_import_trl_trainers_or_gpu_packages():
    code = textwrap.dedent(
        """
        import sys, slimrl
        heavy = [m for m in ("trl.trainer.grpo_trainer", "bitsandbytes", "vllm", "triton") if m in sys.modules]
        print(heavy)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_patch_rebinds_every_public_name_to_slimrl():
    from trl.trainer import grpo_config, grpo_trainer

    slimrl.PatchFastRL("grpo")
    from trl import GRPOConfig, GRPOTrainer

    assert GRPOTrainer is slimrl.GRPOTrainer and GRPOConfig is slimrl.GRPOConfig
    assert trl.trainer.GRPOTrainer is slimrl.GRPOTrainer
    assert grpo_trainer.GRPOTrainer is slimrl.GRPOTrainer and grpo_config.GRPOConfig is slimrl.GRPOConfig
    assert issubclass(slimrl.GRPOTrainer, trl_original("trl", "GRPOTrainer"))


def test_patch_is_idempotent_and_unpatch_restores_originals():
    original_trainer, original_config = trl.GRPOTrainer, trl.GRPOConfig
    slimrl.PatchFastRL("GRPO")  # case-insensitive
    slimrl.PatchFastRL("grpo")
    slimrl.PatchFastRL()
    assert trl.GRPOTrainer is slimrl.GRPOTrainer
    slimrl.unpatch()
    assert trl.GRPOTrainer is original_trainer and trl.GRPOConfig is original_config
    assert trl.trainer.grpo_trainer.GRPOTrainer is original_trainer
    slimrl.unpatch()  # harmless when nothing is patched
    assert trl.GRPOTrainer is original_trainer


def test_unknown_algorithm_lists_supported_ones():
    with pytest.raises(ValueError, match=r"does not know the algorithm 'ppx'.*Supported: .*grpo.*sft"):
        slimrl.PatchFastRL("ppx")


def test_trl_outside_tested_range_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.18.0")
    with pytest.raises(ImportError, match=r"tested with trl >= 1\.16\.0, < 1\.17\.0.*1\.18\.0 is installed"):
        slimrl.PatchFastRL("grpo")


def test_warns_once_when_trainer_was_imported_before_patching(monkeypatch):
    monkeypatch.setattr(patching, "_warned_early_imports", set())
    from trl import GRPOTrainer as EarlyTrainer  # noqa: N814 (the name a user would hold)

    with pytest.warns(UserWarning, match=r"EarlyTrainer.*still point to TRL's original"):
        slimrl.PatchFastRL("grpo")
    slimrl.unpatch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        slimrl.PatchFastRL("grpo")  # second time: no repeated warning
    assert EarlyTrainer is not slimrl.GRPOTrainer


def test_user_script_gets_fast_trainer_after_patching():
    # The script ends with os._exit once its answer is printed: the interpreter's teardown of torch, transformers and
    # TRL (about 2 s on a 2-core machine) would come after it and decide nothing here.
    code = textwrap.dedent(
        """
        from slimrl import FastLanguageModel, PatchFastRL
        PatchFastRL("grpo", FastLanguageModel)
        from trl import GRPOConfig, GRPOTrainer
        import slimrl
        print(GRPOTrainer is slimrl.GRPOTrainer, GRPOConfig is slimrl.GRPOConfig, flush=True)
        import os
        os._exit(0)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[-2:] == ["True", "True"]


@pytest.mark.parametrize("key,name", [("ppo", "PPO"), ("bco", "BCO"), ("prm", "PRM"), ("xpo", "XPO")])
def test_slimrls_own_trainers_are_added_to_trl_and_removed_again(key, name):
    # TRL 1.16 ships none of these: patching adds the names, unpatch takes them away (no stale attribute left)
    trainer, config = f"{name}Trainer", f"{name}Config"
    assert not hasattr(trl, trainer) and not hasattr(trl.trainer, config)
    slimrl.PatchFastRL(key)
    assert getattr(trl, trainer) is getattr(slimrl, trainer) and getattr(trl, config) is getattr(slimrl, config)
    assert getattr(trl.trainer, trainer) is getattr(slimrl, trainer) and patching.is_patched(key)
    slimrl.unpatch(key)
    assert not hasattr(trl, trainer) and not hasattr(trl.trainer, config)
    assert not patching.is_patched(key)


def test_distillation_rebinds_trls_stable_trainer():
    import trl.trainer.distillation_trainer

    original = trl.DistillationTrainer
    slimrl.PatchFastRL("distillation")
    try:
        assert trl.DistillationTrainer is slimrl.DistillationTrainer
        assert trl.trainer.distillation_trainer.DistillationTrainer is slimrl.DistillationTrainer
        assert issubclass(slimrl.DistillationTrainer, original)
    finally:
        slimrl.unpatch("distillation")
    assert trl.DistillationTrainer is original


def test_every_fast_trainer_keeps_trls_model_card_tags_and_adds_slimrl():
    import trl.experimental.cpo
    import trl.experimental.online_dpo
    import trl.experimental.orpo

    pairs = [
        (slimrl.GRPOTrainer, trl.GRPOTrainer),
        (slimrl.RLOOTrainer, trl.RLOOTrainer),
        (slimrl.SFTTrainer, trl.SFTTrainer),
        (slimrl.DPOTrainer, trl.DPOTrainer),
        (slimrl.KTOTrainer, trl.KTOTrainer),
        (slimrl.RewardTrainer, trl.RewardTrainer),
        (slimrl.ORPOTrainer, trl.experimental.orpo.ORPOTrainer),
        (slimrl.CPOTrainer, trl.experimental.cpo.CPOTrainer),
        (slimrl.OnlineDPOTrainer, trl.experimental.online_dpo.OnlineDPOTrainer),
    ]
    for fast, original in pairs:
        assert fast._tag_names == [*original._tag_names, "slimrl"], fast.__name__
    assert slimrl.PPOTrainer._tag_names == ["trl", "ppo", "slimrl"]


def test_a_trainer_built_on_another_ones_trl_class_takes_trls_whenever_it_is_first_imported(monkeypatch):
    # BCO is built on KTO's TRL classes: imported for the first time while slimrl's KTO is patched into trl (as
    # PatchFastRL() for every trainer did, kto's binding before bco's), it used to subclass slimrl's KTO and fail
    # with "Cannot create a consistent method resolution order"
    import importlib
    import sys

    from trl.trainer.kto_config import KTOConfig as TRLKTOConfig
    from trl.trainer.kto_trainer import KTOTrainer as TRLKTOTrainer

    from slimrl.trainers.common.slim_fields import SlimFields

    def forget_bco():  # its modules are imported afresh next time (monkeypatch restores them after the test)
        for name in [m for m in sys.modules if m.startswith("slimrl.trainers.bco")]:
            monkeypatch.delitem(sys.modules, name)

    forget_bco()
    slimrl.PatchFastRL("kto")
    assert trl.KTOConfig is slimrl.KTOConfig
    bco = importlib.import_module("slimrl.trainers.bco.trainer")
    assert bco.BCOConfig.__mro__[1:3] == (SlimFields, TRLKTOConfig)
    assert TRLKTOTrainer in bco.BCOTrainer.__mro__ and slimrl.KTOTrainer not in bco.BCOTrainer.__mro__
    slimrl.unpatch()
    forget_bco()
    slimrl.PatchFastRL()  # every trainer, BCO's module imported after KTO's binding would be
    assert trl.BCOTrainer.__module__ == "slimrl.trainers.bco.trainer" and TRLKTOTrainer in trl.BCOTrainer.__mro__
