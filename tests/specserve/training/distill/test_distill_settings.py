"""Distillation settings refuse what would mean nothing."""

from __future__ import annotations

import pytest

from specserve.errors import InvalidArgument
from specserve.training.distill.settings import DistillSettings


@pytest.mark.parametrize("overrides", [{"feature_noise": -0.1}, {"feature_noise": 0.1, "kind": "glide"}])
def test_feature_noise_is_refused_where_it_means_nothing(tmp_path, overrides) -> None:
    settings = {"features": tmp_path / "features", "out_dir": tmp_path, "kind": "eagle", **overrides}
    with pytest.raises(InvalidArgument, match="feature_noise"):
        DistillSettings(**settings)  # type: ignore[arg-type]
