"""The session's git workspace: a worktree on branch `kloop/<run-id>`, cut from a base commit.

Rules this module keeps (the user must never be surprised):

* The user's checkout is never touched: not its branch, not its index, not its working files.
  Every command that reads the user's repository runs with `--no-optional-locks` (so even
  `git status` does not rewrite their index), and the snapshot of a dirty task folder is built in
  a temporary index. What kloop adds to the repository is the branch `kloop/<run-id>`, the
  worktree's bookkeeping under `.git/worktrees/`, and objects.
* kloop's own git commands never run the repository's hooks (`core.hooksPath=/dev/null`): a
  pre-commit hook must not decide whether an accepted change lands, nor rewrite it.
* Everything the session does to files happens in the worktree, a separate folder given by the
  caller (`worktrees_root/<run-id>`).
* Git runs only where it is told: every command names its repository (`git -C <absolute dir>`,
  started from `/`, no GIT_DIR/GIT_WORK_TREE from the environment, no search above the named
  folder), and every command that changes files, the index or the branch first checks that the
  worktree exists, is a worktree of the user's repository and is on `kloop/<run-id>`
  (`Workspace.verify`); otherwise WorkspaceError, and nothing is done. All of kloop's git is here.

Text that comes out of git (diffs) is decoded as UTF-8 with `surrogateescape`, so a patch of a
file in another encoding survives the round trip `diff()` -> `apply_patch()` byte for byte;
write it back with the same error handler (`agent.records.write_patch` does).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tools.sandbox import minimal_env
from tools.secrets import is_secret_name

BRANCH_PREFIX = "kloop/"
ENCODING = "utf-8"
ERRORS = "surrogateescape"

# modes in git's raw diff output
MODE_SYMLINK = "120000"
MODE_GITLINK = "160000"
MODE_NONE = "000000"

# Files kloop writes at the worktree's root for an agent opened there (the briefing and the rules).
# They are the session's, not the candidate's: never part of a diff, a commit or a restore, as long
# as the base commit does not track a file of that name (then that file is the repository's own).
AGENT_FILES = ("AGENTS.md", "CLAUDE.md", ".mcp.json")


class WorkspaceError(Exception):
    """A git operation kloop needs could not be done; the message says what and why."""

    def __init__(self, message: str, stderr: str = ""):
        super().__init__(message)
        self.stderr = stderr  # git's own words, when a git command failed


@dataclass(frozen=True)
class Change:
    """One changed path between a commit and the working tree (renames show as delete + add)."""

    path: str  # repo-relative, '/'-separated
    status: str  # A added, D deleted, M modified, T type changed (e.g. file <-> symlink)
    old_mode: str  # "000000" when added
    new_mode: str  # "000000" when deleted

    @property
    def is_symlink(self) -> bool:
        return MODE_SYMLINK in (self.old_mode, self.new_mode)

    @property
    def is_submodule(self) -> bool:
        return MODE_GITLINK in (self.old_mode, self.new_mode)

    def __str__(self) -> str:
        kind = " (symlink)" if self.is_symlink else " (submodule)" if self.is_submodule else ""
        return f"{self.status} {self.path}{kind}"


# --------------------------------------------------------------------------------------------
# running git
# --------------------------------------------------------------------------------------------


GIT = shutil.which("git") or "git"

# variables that would point git at another repository, index or work tree than the one named
_LOCATION_ENV = (
    "GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE", "GIT_PREFIX", "GIT_CEILING_DIRECTORIES",
    "GIT_DISCOVERY_ACROSS_FILESYSTEM",
)


def _git(
    repo: Path,
    *args: str,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
    raw: bool = False,
    discover: bool = False,
) -> str | bytes:
    """Run `git -C <repo> <args>`; stdout as text (stripped) or raw bytes; WorkspaceError on failure.

    The repository is always named (`-C`, an absolute path) and git runs from `/`, so a missing
    folder is an error, never "the current directory". Unless `discover`, git may not look for a
    repository above `repo` either (GIT_CEILING_DIRECTORIES): a worktree folder that lost its
    `.git` can never resolve to the user's repository around it. Variables that relocate the
    repository (GIT_DIR, GIT_WORK_TREE, ...) are dropped from the environment; `env` adds to it.
    """
    repo = Path(repo).expanduser().absolute()
    # the allow-list of git_env (no secret reaches git), without the variables that relocate the repository
    full_env = {k: v for k, v in git_env().items() if k not in _LOCATION_ENV}
    if not discover:
        full_env["GIT_CEILING_DIRECTORIES"] = str(repo.parent)
    full_env.update(env or {})
    cmd = [GIT, "-C", str(repo), "--no-optional-locks", "-c", "core.hooksPath=/dev/null", *args]
    try:
        # its own session: a terminal's first Ctrl-C ("stop after this step") must not kill git mid-write
        proc = subprocess.run(cmd, input=stdin, capture_output=True, cwd="/", env=full_env,
                              stdin=None if stdin is not None else subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        raise WorkspaceError(f"git could not be run ({GIT}): {exc}") from None
    if proc.returncode != 0:
        stderr = proc.stderr.decode(ENCODING, "replace").strip()
        raise WorkspaceError(f"git {' '.join(args[:3])} failed in {repo}: {stderr or f'exit {proc.returncode}'}", stderr)
    if raw:
        return proc.stdout
    return proc.stdout.decode(ENCODING, ERRORS).strip()


def git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """git's environment: the allow-list of tools/sandbox.py (no secret reaches git), the user's HOME
    and XDG config (their identity and settings) and their GIT_* settings, then `extra`."""
    keep = {k: v for k, v in os.environ.items()
            if (k.startswith("GIT_") or k in ("XDG_CONFIG_HOME", "TZ")) and not is_secret_name(k)}
    base = {**keep, "LANGUAGE": "C", "TMPDIR": os.environ.get("TMPDIR") or "/tmp"}
    return minimal_env({**base, **(extra or {})}, home=os.environ.get("HOME") or None)


def _identity_env(cwd: Path) -> dict[str, str]:
    """Author/committer for kloop's commits: the user's configured identity, else `kloop`."""
    env: dict[str, str] = {}
    for who in ("AUTHOR", "COMMITTER"):
        try:
            _git(cwd, "var", f"GIT_{who}_IDENT")
        except WorkspaceError:
            env[f"GIT_{who}_NAME"] = "kloop"
            env[f"GIT_{who}_EMAIL"] = "kloop@localhost"
    return env


def _find_repo(path: Path) -> Path:
    """The top of the git repository holding `path` (which must exist)."""
    path = Path(path).expanduser().resolve()
    try:
        bare = _git(path, "rev-parse", "--is-bare-repository", discover=True)
    except WorkspaceError:
        raise WorkspaceError(
            f"{path} is not inside a git repository; kloop keeps every accepted change as a commit, "
            f"so the task folder must be in one (e.g. `git init` and commit the task first)"
        ) from None
    try:
        top = str(_git(path, "rev-parse", "--path-format=absolute", "--show-toplevel", discover=True))
    except WorkspaceError:
        top = ""
    if bare == "true" or not top:
        raise WorkspaceError(f"{path}: the repository holding it is bare or has no working tree here")
    return Path(top).resolve()


def find_repo(path: Path) -> Path | None:
    """The top of the git repository holding `path`, or None when there is none."""
    try:
        return _find_repo(path)
    except WorkspaceError:
        return None


def checkout_of(path: Path) -> tuple[Path, str, Path]:
    """The checkout holding `path`: (its top, the branch checked out there, the top of the main
    repository it belongs to: a linked worktree's common dir's parent). WorkspaceError when `path`
    is in no repository or HEAD is detached."""
    path = Path(path).expanduser().resolve()
    top = _find_repo(path)
    try:
        branch = str(_git(path, "symbolic-ref", "--quiet", "--short", "HEAD", discover=True))
    except WorkspaceError:
        raise WorkspaceError(f"{top}: HEAD is not on a branch") from None
    common = Path(str(_git(path, "rev-parse", "--path-format=absolute", "--git-common-dir", discover=True)))
    return top, branch, common.parent


def holds(path: Path, branch: str, commit: str) -> bool:
    """Whether the repository holding `path` has `branch` and the commit `commit`."""
    try:
        _git(path, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", discover=True)
        _git(path, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", discover=True)
        return True
    except WorkspaceError:
        return False


def _rev(cwd: Path, rev: str) -> str:
    try:
        return str(_git(cwd, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"))
    except WorkspaceError:
        raise WorkspaceError(f"{cwd}: {rev!r} does not name a commit") from None


def _parse_status_z(out: bytes) -> list[str]:
    """Entries of `git status --porcelain=v1 -z --no-renames` as 'XY path' strings."""
    entries = []
    for item in out.split(b"\0"):
        if not item:
            continue
        text = item.decode(ENCODING, ERRORS)
        entries.append(f"{text[:2].strip() or '?'} {text[3:]}")
    return entries


def _parse_raw_z(out: bytes) -> list[Change]:
    """`git diff-index --raw -z --no-renames` output -> changes."""
    parts = out.split(b"\0")
    changes = []
    i = 0
    while i + 1 < len(parts):
        meta = parts[i].decode(ENCODING, ERRORS)
        if not meta.startswith(":"):
            i += 1
            continue
        old_mode, new_mode, _old, _new, status = meta[1:].split(" ")
        path = parts[i + 1].decode(ENCODING, ERRORS)
        changes.append(Change(path=path, status=status[:1], old_mode=old_mode, new_mode=new_mode))
        i += 2
    return changes


def _pathspec(paths: Iterable[str] | None) -> list[str]:
    if paths is None:
        return []
    return ["--", *paths]


# --------------------------------------------------------------------------------------------
# the workspace
# --------------------------------------------------------------------------------------------


class Workspace:
    """A worktree on branch `kloop/<run-id>`; every edit, diff, commit and restore happens here."""

    def __init__(
        self, *, repo_root: Path, base_commit: str, branch: str, path: Path, task_rel: str, run_id: str
    ):
        self.repo_root = repo_root
        self.base_commit = base_commit
        self.branch = branch
        self.path = path
        self.task_rel = task_rel
        self.run_id = run_id
        self._agent_files: tuple[str, ...] | None = None
        self._common_dir: Path | None = None  # the repository's .git, learnt on first use

    @property
    def agent_files(self) -> tuple[str, ...]:
        """The AGENT_FILES the base commit does not track: kloop's own, invisible to diff/commit/restore."""
        if self._agent_files is None:
            tracked = str(_git(self.path, "ls-tree", "--name-only", self.base_commit, "--", *AGENT_FILES))
            self._agent_files = tuple(n for n in AGENT_FILES if n not in tracked.splitlines())
        return self._agent_files

    def _forget_agent_files(self, env: dict[str, str] | None = None) -> None:
        """Drop the agent files from an index (they may have been `git add`ed by an agent)."""
        if self.agent_files:
            _git(self.path, "--literal-pathspecs", "rm", "--cached", "--quiet", "--ignore-unmatch", "--",
                 *self.agent_files, env=env)

    @property
    def task_path(self) -> Path:
        """The task folder inside the worktree."""
        return self.path if self.task_rel in ("", ".") else self.path / self.task_rel

    def __repr__(self) -> str:
        return f"Workspace({self.branch!r} at {self.path}, base {self.base_commit[:12]})"

    # -- creation ------------------------------------------------------------------------------
    @classmethod
    def create(
        cls, task_dir: Path, run_id: str, worktrees_root: Path, allow_dirty: bool = False
    ) -> "Workspace":
        """Cut a worktree for `run_id` from the HEAD of the repository holding `task_dir`.

        A task folder with uncommitted or untracked (not ignored) files is refused, naming them;
        with `allow_dirty`, its current content is snapshot into a commit on top of HEAD (built
        in a temporary index; the user's index and branch are untouched) and that is the base.
        Changes outside the task folder are never part of the base.
        """
        task_dir = Path(task_dir).expanduser().resolve()
        if not task_dir.is_dir():
            raise WorkspaceError(f"{task_dir}: no such task folder")
        repo_root = _find_repo(task_dir)
        task_rel = task_dir.relative_to(repo_root).as_posix()
        branch = BRANCH_PREFIX + run_id
        _check_branch_name(repo_root, branch)
        worktrees_root = Path(worktrees_root).expanduser().resolve()
        path = worktrees_root / run_id
        _check_worktree_location(repo_root, path)

        try:
            head = _rev(repo_root, "HEAD")
        except WorkspaceError:
            raise WorkspaceError(f"{repo_root}: the repository has no commits yet; commit the task first") from None
        if _branch_exists(repo_root, branch):
            raise WorkspaceError(f"{repo_root}: branch {branch!r} already exists (run id reused?)")

        dirty = _dirty_entries(repo_root, task_rel)
        base = head
        if dirty:
            if not allow_dirty:
                listing = "\n".join(f"  {e}" for e in dirty[:50])
                more = f"\n  ... and {len(dirty) - 50} more" if len(dirty) > 50 else ""
                raise WorkspaceError(
                    f"{task_dir} has uncommitted or untracked changes:\n{listing}{more}\n"
                    "kloop starts from a commit, so these would not be part of the run. Commit them, "
                    "or pass --allow-dirty to snapshot the task folder as it is now (your checkout, "
                    "index and branch stay as they are)."
                )
            base = _snapshot(repo_root, task_rel, head, run_id)

        worktrees_root.mkdir(parents=True, exist_ok=True)
        _git(repo_root, "worktree", "add", "--quiet", "-b", branch, str(path), base)
        return cls(repo_root=repo_root, base_commit=base, branch=branch, path=path, task_rel=task_rel, run_id=run_id)

    @classmethod
    def open(
        cls, repo_root: Path, run_id: str, worktrees_root: Path, task_rel: str, base_commit: str
    ) -> "Workspace":
        """Reattach to the worktree of `run_id` (for resume), as recorded in run.json.

        If the worktree folder was deleted, it is recreated from the branch (which holds every
        accepted commit). An existing worktree is taken as it is; the caller decides whether to
        restore it.
        """
        repo_root = _find_repo(Path(repo_root).expanduser())
        branch = BRANCH_PREFIX + run_id
        if not _branch_exists(repo_root, branch):
            raise WorkspaceError(f"{repo_root}: branch {branch!r} does not exist; cannot resume run {run_id}")
        base = _rev(repo_root, base_commit)
        tip = _rev(repo_root, f"refs/heads/{branch}")
        try:
            _git(repo_root, "merge-base", "--is-ancestor", base, tip)
        except WorkspaceError:
            raise WorkspaceError(
                f"{repo_root}: base {base[:12]} is not an ancestor of {branch} ({tip[:12]}); "
                "the branch was rewritten outside kloop"
            ) from None

        path = (Path(worktrees_root).expanduser().resolve()) / run_id
        registered = _worktree_of_branch(repo_root, branch)
        if registered is not None and registered.is_dir():
            path = registered  # the user may have moved it with `git worktree move`
        else:
            if registered is not None:
                _git(repo_root, "worktree", "prune")
            if path.exists() and any(path.iterdir()):
                raise WorkspaceError(f"{path} exists and is not the worktree of {branch}; move it away to resume")
            path.parent.mkdir(parents=True, exist_ok=True)
            _git(repo_root, "worktree", "add", "--quiet", str(path), branch)
        ws = cls(repo_root=repo_root, base_commit=base, branch=branch, path=path, task_rel=task_rel, run_id=run_id)
        current = str(_git(path, "symbolic-ref", "--quiet", "HEAD"))
        if current != f"refs/heads/{branch}":
            raise WorkspaceError(f"{path}: worktree is on {current!r}, expected {branch!r}")
        return ws

    def remove(self) -> None:
        """Delete the worktree folder and its bookkeeping; the branch (the accepted work) stays."""
        if self.path.exists():
            _git(self.repo_root, "worktree", "remove", "--force", "--force", str(self.path))
        _git(self.repo_root, "worktree", "prune")

    # -- the guard before every change -----------------------------------------------------------
    def verify(self, action: str) -> None:
        """Refuse `action` (WorkspaceError, nothing done) unless `path` is this run's worktree:
        an existing folder that is the top of a git worktree of the user's repository, checked out
        on `kloop/<run-id>`. Every command that changes files, the index or the branch calls it
        first, so a deleted or replaced worktree can never turn a restore into a `git clean` of
        somebody else's checkout."""
        where = f"refusing to {action}: the session worktree {self.path}"
        if self.branch != BRANCH_PREFIX + self.run_id:
            raise WorkspaceError(f"{where} is set up on {self.branch!r}, not on {BRANCH_PREFIX + self.run_id!r}")
        if not self.path.is_dir():
            raise WorkspaceError(
                f"{where} does not exist (deleted while the session ran?); nothing was changed. "
                f"The accepted work is on branch {self.branch}; `kloop resume` recreates the worktree."
            )
        try:
            out = str(_git(self.path, "rev-parse", "--path-format=absolute", "--show-toplevel", "--git-common-dir",
                           "--symbolic-full-name", "HEAD"))
        except WorkspaceError as exc:
            raise WorkspaceError(f"{where} is not a git worktree ({exc.stderr or exc}); nothing was changed") from None
        lines = out.splitlines()
        top, common, head = (lines + ["", "", ""])[:3]
        if not top or Path(top).resolve() != self.path.resolve():
            raise WorkspaceError(f"{where} is not the top of a worktree (git says {top!r}); nothing was changed")
        if Path(common).resolve() != self.common_dir():
            raise WorkspaceError(
                f"{where} belongs to the repository {common}, not to {self.repo_root}; nothing was changed"
            )
        if head != f"refs/heads/{self.branch}":
            raise WorkspaceError(
                f"{where} is on {'a detached HEAD' if head in ('', 'HEAD') else repr(head)}, not on {'refs/heads/' + self.branch!r}; "
                "nothing was changed (did something check out another branch there?)"
            )

    def common_dir(self) -> Path:
        """The user's repository's git folder (shared by all its worktrees)."""
        if self._common_dir is None:
            self._common_dir = Path(str(_git(self.repo_root, "rev-parse", "--path-format=absolute",
                                             "--git-common-dir"))).resolve()
        return self._common_dir

    # -- reading -------------------------------------------------------------------------------
    def head(self) -> str:
        return _rev(self.path, "HEAD")

    def _snapshot_index(self, tmpdir: str) -> dict[str, str]:
        """A temporary index holding the working tree as it is (untracked files included).

        Starts from a copy of the worktree's index (its stat cache saves rehashing unchanged files);
        the worktree's own index is never modified by reads.
        """
        index = os.path.join(tmpdir, "index")
        env = {"GIT_INDEX_FILE": index}
        real = Path(str(_git(self.path, "rev-parse", "--path-format=absolute", "--git-path", "index")))
        if real.is_file():
            shutil.copy2(real, index)  # keeps its mtime: git re-reads entries as new as the index (racy git)
        else:
            _git(self.path, "read-tree", "HEAD", env=env)
        _git(self.path, "add", "--all", "--", ".", env=env)
        self._forget_agent_files(env)
        return env

    def changes(self, against: str | None = None, paths: Iterable[str] | None = None) -> list[Change]:
        """Changed paths of the working tree (untracked included, ignored excluded) vs a commit."""
        target = _rev(self.path, against or "HEAD")
        with tempfile.TemporaryDirectory(prefix="kloop-index-") as tmp:
            env = self._snapshot_index(tmp)
            out = _git(
                self.path, "diff-index", "--cached", "--raw", "-z", "--no-renames", target, *_pathspec(paths),
                env=env, raw=True,
            )
        assert isinstance(out, bytes)
        return _parse_raw_z(out)

    def changed_paths(self, against: str | None = None, paths: Iterable[str] | None = None) -> list[str]:
        """Repo-relative paths that differ from `against` (default HEAD): modified, added
        (untracked), deleted, type-changed; a symlink is reported as its own path, never followed.
        Use `changes()` for the status and modes (`Change.is_symlink`)."""
        return [c.path for c in self.changes(against, paths)]

    def diff(self, against: str | None = None, paths: Iterable[str] | None = None) -> str:
        """The working tree (untracked files included) vs `against` (default HEAD) as a binary-safe
        unified patch (`git diff --binary`, no renames, a/ b/ prefixes); '' when nothing changed."""
        target = _rev(self.path, against or "HEAD")
        with tempfile.TemporaryDirectory(prefix="kloop-index-") as tmp:
            env = self._snapshot_index(tmp)
            out = _git(
                self.path, "diff-index", "--cached", "-p", "--binary", "--no-renames", "--no-color",
                "--no-ext-diff", "--no-textconv", "--src-prefix=a/", "--dst-prefix=b/", target,
                *_pathspec(paths), env=env, raw=True,
            )
        assert isinstance(out, bytes)
        return out.decode(ENCODING, ERRORS)

    # -- changing ------------------------------------------------------------------------------
    def restore(self, commit: str | None = None) -> None:
        """Make the working tree and index exactly `commit` (default HEAD): local changes undone,
        untracked and ignored files removed. The branch does not move."""
        self.verify("restore")
        target = _rev(self.path, commit or "HEAD")
        keep = [arg for name in self.agent_files for arg in ("-e", "/" + name)]
        # untracked files first: read-tree refuses to overwrite an untracked file in its way
        _git(self.path, "clean", "-ffdxq", *keep)
        _git(self.path, "read-tree", "--reset", "-u", target)
        _git(self.path, "clean", "-ffdxq", *keep)
        left = self.changes(target)
        if left:
            raise WorkspaceError(
                f"{self.path}: restore to {target[:12]} left differences: {', '.join(map(str, left[:20]))}"
            )

    def apply_patch(self, patch: str) -> None:
        """Apply a patch made by `diff()` to the working tree (not the index); all or nothing."""
        if not patch.strip():
            return
        self.verify("apply a patch")
        data = patch.encode(ENCODING, ERRORS)
        if not data.endswith(b"\n"):
            data += b"\n"
        try:
            _git(self.path, "apply", "--check", "--binary", "--whitespace=nowarn", "-", stdin=data)
        except WorkspaceError as exc:
            raise WorkspaceError(f"patch does not apply to {self.path}:\n{exc.stderr or exc}", exc.stderr) from None
        _git(self.path, "apply", "--binary", "--whitespace=nowarn", "-", stdin=data)

    def commit(self, message: str, paths: Iterable[str] | None = None, allow_empty: bool = False) -> str:
        """Commit the working tree's changes (only `paths`, repo-relative, when given) on the
        branch, untracked files included; returns the new sha.

        The message is kept verbatim (no comment stripping: a rationale may quote `#include`).
        """
        self.verify("commit")
        path_list = None if paths is None else list(paths)
        lit = "--literal-pathspecs"
        spec = ["--", "."] if path_list is None else ["--", *path_list]
        args = ["commit", "--quiet", "--no-verify", "--cleanup=verbatim", "--file=-"]
        if path_list == []:
            if not allow_empty:
                raise WorkspaceError("commit: an empty list of paths commits nothing")
            args += ["--allow-empty", "--only"]
        else:
            _git(self.path, lit, "add", "--all", *spec)
            self._forget_agent_files()
            staged = _git(self.path, lit, "diff-index", "--cached", "--name-only", "HEAD", *spec)
            if not staged:
                if not allow_empty:
                    raise WorkspaceError(f"{self.path}: nothing to commit")
                args.append("--allow-empty")
            if path_list is not None:
                args += ["--only", *spec]
        _git(self.path, lit, *args, env=_identity_env(self.path), stdin=message.encode(ENCODING, ERRORS))
        return self.head()

    def reset_branch(self, commit: str) -> None:
        """Move the session branch to `commit` (an earlier commit of it: resume cuts off commits
        that carry no accepted verdict), working tree and index with it."""
        self.verify("move the branch")
        target = _rev(self.path, commit)
        try:
            _git(self.path, "merge-base", "--is-ancestor", target, "HEAD")
        except WorkspaceError:
            raise WorkspaceError(f"refusing to move {self.branch} to {target[:12]}: not a commit of the branch") from None
        _git(self.path, "reset", "--hard", "--quiet", target)

    def commits_since_base(self) -> list[tuple[str, str]]:
        """(sha, full message) of the branch's commits after the base, oldest first."""
        return [(c.sha, c.message) for c in commit_log(self.repo_root, f"{self.base_commit}..refs/heads/{self.branch}")]

    def export_tree(self, commit: str, dest: Path, subdir: str | None = None) -> Path:
        """Write the files of `commit` (only `subdir`, as the root, when given) into `dest`.

        `dest` must not exist or be empty. Used to build from the trusted base: nothing of the
        working tree is read. Returns `dest`.
        """
        return export_commit(self.repo_root, commit, dest, subdir)


# --------------------------------------------------------------------------------------------
# helpers on the user's repository (read-only, except branch/worktree creation)
# --------------------------------------------------------------------------------------------


def _check_branch_name(repo_root: Path, branch: str) -> None:
    try:
        _git(repo_root, "check-ref-format", "--branch", branch)
    except WorkspaceError:
        raise WorkspaceError(f"{branch!r} is not a valid branch name (from the run id)") from None


def _branch_exists(repo_root: Path, branch: str) -> bool:
    try:
        _git(repo_root, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}")
        return True
    except WorkspaceError:
        return False


def _check_worktree_location(repo_root: Path, path: Path) -> None:
    git_dir = Path(str(_git(repo_root, "rev-parse", "--path-format=absolute", "--git-common-dir"))).resolve()
    if path.is_relative_to(git_dir):
        raise WorkspaceError(f"{path}: worktrees must not live inside {git_dir} (tools walking .git trip on them)")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise WorkspaceError(f"{path} already exists and is not empty")
    if path.is_relative_to(repo_root):
        rel = path.relative_to(repo_root).as_posix()
        try:
            _git(repo_root, "check-ignore", "--quiet", "--no-index", rel + "/")
        except WorkspaceError:
            raise WorkspaceError(
                f"{path} is inside the repository {repo_root} and not ignored: the worktree would show "
                "up in your `git status`; put worktrees outside the repository or in an ignored folder"
            ) from None


def _dirty_entries(repo_root: Path, task_rel: str) -> list[str]:
    out = _git(
        repo_root, "--literal-pathspecs", "status", "--porcelain=v1", "-z", "--no-renames",
        "--untracked-files=all", "--ignore-submodules=none", "--", task_rel or ".", raw=True,
    )
    assert isinstance(out, bytes)
    return _parse_status_z(out)


def _snapshot(repo_root: Path, task_rel: str, head: str, run_id: str) -> str:
    """A commit on top of `head` whose task folder is the current working content (temp index)."""
    with tempfile.TemporaryDirectory(prefix="kloop-index-") as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
        _git(repo_root, "read-tree", head, env=env)
        _git(repo_root, "--literal-pathspecs", "add", "--all", "--", task_rel or ".", env=env)
        tree = str(_git(repo_root, "write-tree", env=env))
    message = (
        f"kloop: snapshot of {task_rel or '.'} with uncommitted changes\n\n"
        f"The working content of the task folder when run {run_id} started (--allow-dirty).\n"
    )
    env = _identity_env(repo_root)
    return str(_git(repo_root, "commit-tree", tree, "-p", head, env=env, stdin=message.encode()))


def _worktree_of_branch(repo_root: Path, branch: str) -> Path | None:
    out = str(_git(repo_root, "worktree", "list", "--porcelain"))
    current: Path | None = None
    for line in out.splitlines():
        if line.startswith("worktree "):
            current = Path(line[len("worktree "):])
        elif line == f"branch refs/heads/{branch}":
            return current
    return None



# --------------------------------------------------------------------------------------------
# reading a repository without a session (the CLI's log, replay)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommitMessage:
    sha: str
    message: str  # the full message, as committed

    @property
    def summary(self) -> str:
        return self.message.split("\n", 1)[0]


def commit_log(repo_root: Path, rev_range: str) -> list[CommitMessage]:
    """The commits of `rev_range` (e.g. `base..kloop/<id>`) in `repo_root`, oldest first."""
    repo = _find_repo(repo_root)
    if rev_range.startswith("-"):
        raise WorkspaceError(f"{rev_range!r} is not a revision range")
    out = _git(repo, "log", "-z", "--reverse", "--format=%H%n%B", rev_range, "--", raw=True)
    assert isinstance(out, bytes)
    commits = []
    for item in out.split(b"\0"):
        if not item.strip():
            continue
        sha, _, message = item.decode(ENCODING, ERRORS).lstrip("\n").partition("\n")
        commits.append(CommitMessage(sha=sha, message=message))
    return commits


def export_commit(repo_root: Path, commit: str, dest: Path, subdir: str | None = None, keep_paths: bool = False) -> Path:
    """Write the files of `commit` (only `subdir` when given) into `dest`; nothing of any working
    tree is read. With `keep_paths`, files land at their repository paths (dest/subdir/...) and
    the folder of the subdir is returned; otherwise `subdir` becomes the root of `dest`.

    `dest` must not exist or be empty.
    """
    dest = Path(dest).expanduser().resolve()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise WorkspaceError(f"{dest}: export destination must be a new or empty folder")
    sha = _rev(repo_root, commit)
    sub = (subdir or "").strip("/")
    sub = "" if sub == "." else sub
    treeish = f"{sha}:{sub}" if sub else f"{sha}^{{tree}}"
    try:
        tree = str(_git(repo_root, "rev-parse", "--verify", "--quiet", treeish))
        if _git(repo_root, "cat-file", "-t", tree) != "tree":
            raise WorkspaceError("not a tree")
    except WorkspaceError:
        raise WorkspaceError(f"commit {sha[:12]} has no folder {sub!r}") from None
    dest.mkdir(parents=True, exist_ok=True)
    prefix = [f"--prefix={sub}/"] if keep_paths and sub else []
    with tempfile.TemporaryDirectory(prefix="kloop-index-") as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
        _git(repo_root, "read-tree", *prefix, tree, env=env)
        _git(repo_root, "checkout-index", "--all", "--force", f"--prefix={dest}/", env=env)
    return dest / sub if keep_paths and sub else dest


def resolve_commit(repo_root: Path, rev: str) -> str:
    """The full sha of `rev` in the repository holding `repo_root` (WorkspaceError naming it if none)."""
    if rev.startswith("-"):
        raise WorkspaceError(f"{rev!r} is not a revision")
    return _rev(_find_repo(repo_root), rev)


def commit_parent(repo_root: Path, commit: str) -> str | None:
    """The first parent of `commit`, None for a root commit."""
    try:
        return str(_git(_find_repo(repo_root), "rev-parse", "--verify", "--quiet", f"{commit}^1^{{commit}}"))
    except WorkspaceError:
        return None


def commit_changes(repo_root: Path, old: str, new: str) -> list[str]:
    """Repo-relative paths that differ between two commits (no renames: both sides of a move)."""
    out = _git(_find_repo(repo_root), "diff-tree", "-r", "-z", "--no-renames", "--name-only", old, new, "--", raw=True)
    assert isinstance(out, bytes)
    return sorted({p for p in out.decode(ENCODING, ERRORS).split("\0") if p})


def commit_diff(repo_root: Path, old: str, new: str, subdir: str | None = None) -> str:
    """The patch from commit `old` to `new` (only `subdir` when given), as `Workspace.diff` writes
    patches (binary-safe, no renames, a/ b/ prefixes): what `apply_patch_to_folder` applies."""
    sub = (subdir or "").strip("/")
    spec = [f":(literal){sub}"] if sub and sub != "." else []
    out = _git(_find_repo(repo_root), "diff-tree", "-r", "-p", "--binary", "--no-renames", "--no-color", "--no-ext-diff",
               "--no-textconv", "--src-prefix=a/", "--dst-prefix=b/", old, new, "--", *spec, raw=True)
    assert isinstance(out, bytes)
    return out.decode(ENCODING, ERRORS)


def file_at(repo_root: Path, commit: str, path: str) -> bool:
    """True when `path` is a file (blob) in `commit`."""
    try:
        return _git(_find_repo(repo_root), "cat-file", "-t", f"{commit}:{path.strip('/')}") == "blob"
    except WorkspaceError:
        return False


def apply_patch_to_folder(folder: Path, patch: str) -> str | None:
    """Apply a patch made by `Workspace.diff()` to a plain folder (no repository: replay's scratch
    copies); all or nothing. Returns git's complaint when it does not apply, else None."""
    if not patch.strip():
        return None
    data = patch.encode(ENCODING, ERRORS)
    if not data.endswith(b"\n"):
        data += b"\n"
    try:
        # the ceiling keeps git from taking a repository around `folder` as the patch's root
        _git(folder, "apply", "--binary", "--whitespace=nowarn", "-", stdin=data)
    except WorkspaceError as exc:
        return exc.stderr or str(exc)
    return None


# --------------------------------------------------------------------------------------------
# kloop's own bookkeeping in a repository: the ignore rule for .kloop/, shipped tasks' repositories
# --------------------------------------------------------------------------------------------


def ensure_excluded(repo_root: Path, pattern: str) -> None:
    """Add `pattern` to the repository's `.git/info/exclude` (local, never committed; the user's
    .gitignore is not touched) unless it is there already."""
    exclude = Path(str(_git(repo_root, "rev-parse", "--path-format=absolute", "--git-path", "info/exclude")))
    text = exclude.read_text(encoding="utf-8") if exclude.is_file() else ""
    if pattern in text.splitlines():
        return
    exclude.parent.mkdir(parents=True, exist_ok=True)
    prefix = "" if not text or text.endswith("\n") else "\n"
    with exclude.open("a", encoding="utf-8") as f:
        f.write(f"{prefix}# kloop's run records and session worktrees\n{pattern}\n")


def init_repo(path: Path) -> None:
    """A new repository at `path` (an existing folder) on branch main."""
    _git(path, "init", "--quiet", "--initial-branch=main")


def is_clean(repo_root: Path) -> bool:
    """No uncommitted or untracked (not ignored) files in the repository."""
    return not _git(repo_root, "status", "--porcelain=v1", "--untracked-files=all")


def commit_all(repo_root: Path, message: str) -> str:
    """Commit every file of the repository's working tree (kloop's own task repositories only)."""
    _git(repo_root, "add", "--all", "--", ".")
    _git(repo_root, "commit", "--quiet", "--no-verify", "--allow-empty", "--cleanup=verbatim", "--file=-",
         env=_identity_env(repo_root), stdin=message.encode(ENCODING, ERRORS))
    return _rev(repo_root, "HEAD")
