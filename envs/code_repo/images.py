"""Per-record Docker images: SWE-bench's way of shipping a repository with its runtime.

A record run on the docker backend names an image (its ``image_name`` column, or
``envs.domains.code_repo.dataset_image``, a template over ``{repo}``, ``{name}`` -- the last part
of ``repo`` -- and ``{instance_id}``) whose working directory (``/testbed`` as in SWE-bench's
images; the image's ``WORKDIR`` must be it) holds the repository as a git checkout containing
``base_commit``. The host reads that repository once per image (:func:`export_repo`, through a
stopped container: nothing runs) and derives the trees the bwrap path derives from a bundle
(``snapshot.RepoStore``): the agent's working dir, the verifier's test files, the scripted
policies' edits. Images are never pulled (there may be no registry): :func:`missing_images` lists
those the daemon does not have, once at load; such a task's episodes fail with ``EnvError``
naming the image.
"""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any

from jointrl.envs.sandbox.base import Sandbox, SandboxConfig
from jointrl.envs.sandbox.bwrap import BwrapSandbox
from jointrl.envs.sandbox.docker import DockerSandbox, client

_WARNED: set[str] = set()


def image_name(template: str, repo: str, instance_id: str) -> str:
    """``template`` filled from a record (``{repo}``, ``{name}``, ``{instance_id}``).

    >>> image_name("swe/{name}:{instance_id}", "org/ledger", "ledger-2")
    'swe/ledger:ledger-2'
    """
    try:
        return template.format(repo=repo, name=repo.rstrip("/").split("/")[-1], instance_id=instance_id)
    except (KeyError, IndexError) as e:
        raise ValueError(f"dataset_image {template!r}: unknown field {e}; fields: repo, name, instance_id") from e


def missing_images(images: dict[str, list[str]]) -> list[str]:
    """The images (of ``{image: [instance ids]}``) the Docker daemon does not have. The first time
    an image is found missing in this process, one line names it and its instances on stderr."""
    import docker.errors

    cli = client()
    missing = []
    for image in sorted(images):
        try:
            cli.images.get(image)
        except docker.errors.ImageNotFound:
            missing.append(image)
    if fresh := [m for m in missing if m not in _WARNED]:
        _WARNED.update(fresh)
        print("jointrl: warning: code_repo: docker images not on this host (their tasks will fail; build or "
              "load them, nothing is pulled): " + "; ".join(f"{m} ({', '.join(images[m][:5])})" for m in fresh),
              file=sys.stderr, flush=True)
    return missing


def export_repo(image: str, workdir: str, dest: Path) -> None:
    """Copy ``image``'s ``workdir`` (a git repository) to the host folder ``dest``. Raises
    ``ValueError`` when the image is missing, its WORKDIR is not ``workdir``, or it holds no git
    repository there."""
    import docker.errors

    cli = client()
    try:
        info = cli.images.get(image).attrs
    except docker.errors.ImageNotFound as e:
        raise ValueError(f"docker image {image!r} is not on this host (build or load it; nothing is pulled)") from e
    have = (info.get("Config") or {}).get("WorkingDir") or ""
    if PurePosixPath(have or "/") != PurePosixPath(workdir):
        raise ValueError(f"docker image {image!r}: its WORKDIR is {have or 'unset'!r}, the record's working dir "
                         f"is {workdir!r}; they must be the same")
    container = cli.containers.create(image, ["true"], entrypoint=[], network_mode="none")
    try:
        bits, _ = container.get_archive(workdir)
        data = b"".join(bits)
    finally:
        container.remove(force=True)
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:  # members "<basename>/..."
        tar.extractall(dest, filter="data")
    (inner,) = list(dest.iterdir())
    if not (inner / ".git").exists():
        raise ValueError(f"docker image {image!r} has no git repository at {workdir!r}")
    for p in inner.iterdir():
        p.rename(dest / p.name)
    inner.rmdir()


def open_sandbox(record: SweRecord, config: SandboxConfig, workdir_from: Path, **kwargs: Any) -> Sandbox:
    """A sandbox whose working dir holds a copy of ``workdir_from``: bwrap's ``/work``, or a
    container of ``record.image`` at its ``record.workdir`` (not seeded from the image)."""
    if not record.image:
        return BwrapSandbox(config, workdir_from, **kwargs)
    return DockerSandbox(config, workdir_from, image=record.image, seed_workdir=False, **kwargs)
