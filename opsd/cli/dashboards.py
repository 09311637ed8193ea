"""``opsd dashboards push``: put opsd's Grafana dashboards into a Grafana folder through its HTTP API.

The Grafana calls go through the ``grafana-api`` library: ``GET /api/folders`` (find the folder by title),
``POST /api/folders`` (create it when missing) and ``POST /api/dashboards/db`` with ``overwrite: true`` for each
dashboard (a dashboard with the same uid is replaced). Its exceptions become ``OpsError``s here.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from opsd.errors import ConfigError, OpsError, PermanentError, TransientError
from opsd.protocol.env import GRAFANA_TOKEN_ENV

log = logging.getLogger(__name__)

T = TypeVar("T")

dashboards_app = typer.Typer(
    name="dashboards",
    help="opsd's Grafana dashboards (docs/dashboards.md).",
    no_args_is_help=True,
    add_completion=False,
)


@dataclass(frozen=True)
class GrafanaTarget:
    """Where to push: Grafana's base URL (with any path prefix), a service-account token, the folder's title
    (empty: Grafana's General folder) and the timeout of each request."""

    url: str
    token: str
    folder: str = "opsd"
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"--grafana-url must be http(s)://HOST[:PORT][/PREFIX], not {self.url!r}")
        try:
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError:
            raise ConfigError(f"--grafana-url has a bad port: {self.url!r}") from None
        if not self.token:
            raise ConfigError("--token must not be empty (a Grafana service-account token)")
        if self.timeout_s <= 0:
            raise ConfigError("--timeout-s must be > 0")

    def client(self) -> Any:
        """A ``grafana_api`` client (imported here: the rest of the CLI does not pay for it)."""
        from grafana_api.grafana_face import GrafanaFace

        parts = urllib.parse.urlsplit(self.url)
        host = parts.hostname or ""
        prefix = parts.path.strip("/")
        return GrafanaFace(
            auth=self.token,
            host=f"[{host}]" if ":" in host else host,  # the library writes host:port as given
            port=parts.port,
            url_path_prefix=f"{prefix}/" if prefix else "",
            protocol=parts.scheme,
            timeout=self.timeout_s,
        )


def load_dashboards(directory: Path) -> dict[str, dict[str, Any]]:
    """The dashboards in ``directory/*.json`` by file name; ConfigError when there are none or one is not a
    dashboard (a JSON object with a uid and a title)."""
    if not directory.is_dir():
        raise ConfigError(f"--dir {directory} is not a directory")
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.json")):
        try:
            board = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: not readable as JSON ({exc})") from None
        if not isinstance(board, dict) or not board.get("uid") or not board.get("title"):
            raise ConfigError(f"{path}: not a Grafana dashboard (a JSON object with a uid and a title)")
        found[path.name] = board
    if not found:
        raise ConfigError(f"--dir {directory} has no *.json dashboards")
    return found


def _call(what: str, url: str, call: Callable[[], T]) -> T:
    """Run one Grafana call, turning what the library and requests raise into OpsErrors."""
    import requests
    from grafana_api.grafana_api import (
        GrafanaClientError,
        GrafanaException,
        GrafanaServerError,
        GrafanaUnauthorizedError,
    )

    try:
        return call()
    except GrafanaUnauthorizedError:
        raise PermanentError(f"Grafana at {url} refused the token (401 Unauthorized) while {what}") from None
    except GrafanaServerError as exc:
        raise TransientError(f"Grafana at {url} failed while {what}: {exc.message}") from None
    except GrafanaClientError as exc:
        raise PermanentError(f"Grafana at {url} refused {what}: {exc.message}") from None
    except GrafanaException as exc:
        raise PermanentError(f"Grafana at {url}: {exc.message} while {what}") from None
    except (requests.ConnectionError, requests.Timeout) as exc:
        raise TransientError(f"cannot reach Grafana at {url} ({type(exc).__name__}) while {what}") from None
    except (requests.RequestException, ValueError) as exc:  # a body that is not JSON, a bad URL
        raise PermanentError(f"Grafana at {url} answered something unexpected while {what}: {exc}") from None


def ensure_folder(client: Any, url: str, title: str) -> tuple[str, int]:
    """(uid, id) of the folder titled ``title``, created when missing; ("", 0) for the General folder."""
    if not title:
        return "", 0
    folders = _call("listing folders", url, client.folder.get_all_folders)
    for f in folders if isinstance(folders, list) else []:
        if isinstance(f, dict) and f.get("title") == title:
            log.info("Grafana folder %r exists (uid %s)", title, f.get("uid"))
            return _folder_ids(url, f)
    created = _call(f"creating folder {title!r}", url, lambda: client.folder.create_folder(title))
    log.info("Grafana folder %r created: %s", title, created)
    return _folder_ids(url, created)


def _folder_ids(url: str, folder: Any) -> tuple[str, int]:
    try:
        uid, folder_id = str(folder["uid"]), int(folder.get("id", 0))
    except (TypeError, KeyError, ValueError, AttributeError):
        raise PermanentError(f"Grafana at {url} described a folder without a uid or id: {folder!r}") from None
    if not uid:
        raise PermanentError(f"Grafana at {url} described a folder without a uid: {folder!r}")
    return uid, folder_id


def push_dashboard(client: Any, url: str, board: dict[str, Any], folder: tuple[str, int]) -> dict[str, Any]:
    """POST one dashboard into ``folder`` (uid, id), replacing the one with its uid; returns Grafana's answer."""
    body = {
        "dashboard": {**board, "id": None},  # matched by uid: a new id would conflict with an existing dashboard
        "folderUid": folder[0],
        "folderId": folder[1],  # older Grafana versions read the id, newer ones the uid
        "overwrite": True,
        "message": "opsd dashboards push",
    }
    answer = _call(f"saving dashboard {board.get('uid')!r}", url, lambda: client.dashboard.update_dashboard(body))
    return answer if isinstance(answer, dict) else {}


@dashboards_app.command()
def push(
    grafana_url: Annotated[
        str, typer.Option(help="Grafana's base URL, e.g. http://grafana:3000 or https://host/grafana")
    ],
    token: Annotated[str, typer.Option(envvar=GRAFANA_TOKEN_ENV, help="Grafana service-account token (Editor)")],
    folder: Annotated[
        str, typer.Option(help="folder title, created when missing (empty: the General folder)")
    ] = "opsd",
    directory: Annotated[str, typer.Option("--dir", help="directory of the dashboard *.json files")] = "dashboards",
    timeout_s: Annotated[float, typer.Option(help="seconds per Grafana request")] = 10.0,
) -> None:
    """Push the dashboards of --dir into a Grafana folder (each replaces the dashboard with its uid).

    Exit codes: 0 all pushed; 1 Grafana unreachable, the token refused (401), a request refused or failed (4xx/5xx);
    2 bad arguments or no readable dashboards in --dir.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    try:
        target = GrafanaTarget(grafana_url, token, folder, timeout_s)
        boards = load_dashboards(Path(directory))
    except ConfigError as exc:
        typer.echo(f"opsd dashboards push: {exc}", err=True)
        raise typer.Exit(2) from None
    client = target.client()
    console = Console(stderr=True)
    pushed: list[str] = []
    try:
        folder_ids = ensure_folder(client, grafana_url, folder)
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        ) as progress:
            task = progress.add_task("pushing dashboards", total=len(boards))
            for name, board in boards.items():
                progress.update(task, description=f"pushing {name}")
                answer = push_dashboard(client, grafana_url, board, folder_ids)
                pushed.append(f"{board['title']}: {urllib.parse.urljoin(grafana_url, str(answer.get('url', '')))}")
                progress.advance(task)
    except OpsError as exc:
        done = f" ({len(pushed)} of {len(boards)} dashboards pushed before)" if pushed else ""
        typer.echo(f"opsd dashboards push: {exc}{done}", err=True)
        raise typer.Exit(1) from None
    for line in pushed:
        typer.echo(line)
    where = f"folder {folder!r}" if folder else "the General folder"
    typer.echo(f"{len(pushed)} dashboards pushed to {where} of {grafana_url}")
