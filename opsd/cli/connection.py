"""How the operator's commands reach the controller, and the options they share.

Where the controller is: ``--url``, else ``$OPSD_URL``, else ``url`` in the client's config file (``--config``,
``$OPSD_CONFIG`` or ``~/.config/opsd/config.toml``: a TOML file with ``url`` and ``token``), else
http://127.0.0.1:8470. The token likewise (``--token``, ``$OPSD_TOKEN``, ``token`` in the config file), else the file
``token`` in the state directory that ``opsd serve`` / ``opsd run`` write.

A command that talks to the controller is decorated with ``connected``: it declares ``api: ApiClient`` and gets the
connection options (``--url``, ``--token``, ``--state-dir``, ``--state-url``, ``--config``) without repeating them.
When no controller answers, a read command reads the state store instead (``opsd.cli.offline``): ``--state-url``,
``$OPSD_STATE_URL``, or ``STATE_DIR/opsd.db`` when it exists: a finished run's record needs no controller.

Exit codes: 0 done; 1 the controller refused, failed or could not be reached (the reason on stderr); 2 a bad
command line or config file; 3 ``restart --wait`` gave up waiting (the restart goes on).
"""

from __future__ import annotations

import functools
import inspect
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar, get_type_hints

import typer

from opsd.cli.client import ApiClient, HttpClient
from opsd.errors import OpsError
from opsd.protocol.answers import decode_answer
from opsd.protocol.env import CLIENT_CONFIG_ENV, STATE_DIR_ENV, STATE_URL_ENV, TOKEN_ENV, URL_ENV

A = TypeVar("A")
DEFAULT_URL = "http://127.0.0.1:8470"
EXIT_ERROR, EXIT_USAGE, EXIT_TIMEOUT = 1, 2, 3

Url = Annotated[
    str | None, typer.Option("--url", envvar=URL_ENV, help="the controller (default: config file, then localhost)")
]
Token = Annotated[
    str | None,
    typer.Option("--token", envvar=TOKEN_ENV, help="bearer token (default: config file, STATE_DIR/token)"),
]
StateDir = Annotated[
    str, typer.Option("--state-dir", envvar=STATE_DIR_ENV, help="where the token file (and the state store) are")
]
StateUrl = Annotated[
    str | None,
    typer.Option(
        "--state-url",
        envvar=STATE_URL_ENV,
        help="the state store read when no controller answers (default: STATE_DIR/opsd.db)",
    ),
]
ClientConfig = Annotated[
    str | None, typer.Option("--config", envvar=CLIENT_CONFIG_ENV, help="TOML with url and token (the client's)")
]
AsJson = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]
Wide = Annotated[bool, typer.Option("--wide", help="the secondary columns too, however wide the table gets")]
RunName = Annotated[str, typer.Option("--run", help="the run")]

_CONNECTION = [
    inspect.Parameter("url", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Url),
    inspect.Parameter("token", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Token),
    inspect.Parameter("state_dir", inspect.Parameter.KEYWORD_ONLY, default=".opsd", annotation=StateDir),
    inspect.Parameter("state_url", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=StateUrl),
    inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=ClientConfig),
]
P = ParamSpec("P")
R = TypeVar("R")


def connected(command: Callable[..., R]) -> Callable[..., R]:
    """``command`` with the connection options added to its command line, and its ``api`` parameter (an
    ``ApiClient``) made from them."""
    hints = get_type_hints(command, include_extras=True)
    signature = inspect.signature(command)
    params = [p.replace(annotation=hints[p.name]) for p in signature.parameters.values() if p.name != "api"]
    params += _CONNECTION

    @functools.wraps(command)
    def with_api(
        *args: Any,
        url: str | None,
        token: str | None,
        state_dir: str,
        state_url: str | None,
        config: str | None,
        **kwargs: Any,
    ) -> R:
        return command(*args, api=client(url, token, state_dir, config, state_url), **kwargs)

    with_api.__signature__ = signature.replace(parameters=params, return_annotation=hints.get("return"))  # type: ignore[attr-defined]
    with_api.__annotations__ = {p.name: p.annotation for p in params}
    del with_api.__wrapped__  # typer reads the signature above, not the command's
    return with_api


def config_file(path: str | None) -> dict[str, str]:
    """``url`` and ``token`` from the client's config file; a missing default file is no error, a bad one is."""
    chosen = Path(path) if path else Path.home() / ".config" / "opsd" / "config.toml"
    if not chosen.exists():
        if path:
            fail(f"config file {chosen} does not exist", EXIT_USAGE)
        return {}
    try:
        doc = tomllib.loads(chosen.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        fail(f"config file {chosen}: {exc}", EXIT_USAGE)
    unknown = set(doc) - {"url", "token"}
    bad = [k for k in ("url", "token") if k in doc and not isinstance(doc[k], str)]
    if unknown or bad:
        fail(f"config file {chosen}: keys are url and token (strings); got {sorted(unknown | set(bad))}", EXIT_USAGE)
    return {str(k): str(v) for k, v in doc.items()}


def client(
    url: str | None, token: str | None, state_dir: str, config: str | None, state_url: str | None = None
) -> ApiClient:
    """The controller at ``url`` (else the config file's, else localhost); its state store when it does not
    answer a read (``opsd.cli.offline``)."""
    from opsd.cli.offline import Reader, store_url

    found = config_file(config) if url is None or token is None else {}
    try:
        http = HttpClient(url or found.get("url") or DEFAULT_URL, token or found.get("token") or None, state_dir)
    except OpsError as exc:
        fail(str(exc), EXIT_USAGE)
    return Reader(http, store_url(state_dir, state_url))


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    typer.echo(f"opsd: {message}", err=True)
    raise typer.Exit(code)


def call(api: ApiClient, method: str, path: str, body: Mapping[str, object] | None = None) -> Any:
    try:
        return api.post(path, body) if method == "POST" else api.get(path)
    except OpsError as exc:
        fail(str(exc))


def read(api: ApiClient, path: str, kind: type[A], what: str) -> A:
    """The answer to ``GET path`` as ``kind`` (``opsd.protocol.answers``, ``records``, ...); one that does not fit
    fails the command, naming the field."""
    return typed(call(api, "GET", path), kind, f"{what} (GET {path})")


def typed(answer: Any, kind: type[A], what: str) -> A:
    """An answer (decoded JSON) as ``kind``; one that does not fit fails the command, naming ``what`` and the field."""
    try:
        return decode_answer(answer, kind, what)
    except OpsError as exc:
        fail(str(exc))


def write(text: str, path: str) -> None:
    """``text`` to the file ``path``, or to standard output when ``path`` is empty."""
    if not path:
        typer.echo(text, nl=not text.endswith("\n"))
        return
    try:
        Path(path).write_text(text)
    except OSError as exc:
        fail(f"cannot write {path}: {exc}")
