"""`dsec edge` tells its network policy layer its own URL and its apiservers': no tenant rule
may name them, even when they live on other hosts."""

from __future__ import annotations

import pytest

from dsec import errors
from dsec.config import EdgeSettings
from dsec.edge.server import create_edge_app
from dsec.models import NetworkPolicy

pytestmark = pytest.mark.asyncio


async def test_edge_refuses_rules_to_its_own_url_and_apiservers(tmp_path) -> None:
    settings = EdgeSettings(
        name="tplat",
        data_dir=tmp_path / "data",
        run_dir=tmp_path / "run",
        platform_addresses=["10.77.9.0/24"],
    )
    app = create_edge_app(
        settings, token="t", public_url="http://10.77.0.5:9000", apiservers=["http://10.77.1.6:8420"]
    )
    net = app.state.edge.net
    for address in ("10.77.0.5", "10.77.1.6", "10.77.9.200"):
        with pytest.raises(errors.InvalidRequest) as e:
            await net.check(NetworkPolicy.model_validate({"allow": [{"to": address}]}))
        assert address in str(e.value)
    await net.check(NetworkPolicy.model_validate({"allow": [{"to": "10.77.2.7"}]}))  # not the platform
