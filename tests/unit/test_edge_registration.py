"""Where an edge sends its registrations (dsec.edge.server.registration_urls): a name with
several addresses, such as a Kubernetes headless Service over the apiserver pods, reaches every
apiserver behind it; anything else is the URL as given."""

from __future__ import annotations

import pytest

from dsec.edge.server import Resolver, registration_urls


def resolver(answers: dict[str, list[str]]) -> Resolver:
    async def resolve(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError(f"cannot resolve {host}")
        return answers[host]

    return resolve


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "http://dsec-apiserver-peers.dsec.svc:8420",
            ["http://10.1.0.5:8420", "http://10.1.2.7:8420", "http://[fd00::9]:8420"],
        ),
        ("http://one.example:8420/", ["http://one.example:8420/"]),  # one address: as given
        ("http://10.0.0.1:8420", ["http://10.0.0.1:8420"]),  # an IP
        ("https://dsec-apiserver-peers.dsec.svc:8420", ["https://dsec-apiserver-peers.dsec.svc:8420"]),
        ("http://gone.example:8420", ["http://gone.example:8420"]),  # unresolvable now: logged later
    ],
)
async def test_registration_urls(url: str, expected: list[str]) -> None:
    answers = {
        "dsec-apiserver-peers.dsec.svc": ["10.1.0.5", "10.1.2.7", "10.1.0.5", "fd00::9"],
        "one.example": ["192.0.2.1"],
    }
    assert await registration_urls(url, resolver(answers)) == expected


async def test_registration_urls_default_port_and_path() -> None:
    got = await registration_urls(
        "http://peers.example/base", resolver({"peers.example": ["10.0.0.1", "10.0.0.2"]})
    )
    assert got == ["http://10.0.0.1:80/base", "http://10.0.0.2:80/base"]
