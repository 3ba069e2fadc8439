"""Programmatic dependent launch only where the device has it."""

from __future__ import annotations

import torch


def test_programmatic_dependent_launch_only_where_the_device_has_it(monkeypatch):
    from slimrl.rollout.kernels import common as pdl

    # Triton's interpreter and CPU tensors have no grid dependency control: the kernels launch as usual there
    assert pdl.options(torch.device("cpu")) == {"PDL": 0, "launch_pdl": False}
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert pdl.options(torch.device("cuda"))["launch_pdl"] == (hopper and pdl._HAVE_GDC)
        monkeypatch.setattr(pdl, "MODE", 0)  # SLIMRL_PDL=0
        assert pdl.options(torch.device("cuda")) == {"PDL": 0, "launch_pdl": False}

