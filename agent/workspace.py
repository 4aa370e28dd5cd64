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

Text that comes out of git (diffs) is decoded as UTF-8 with `surrogateescape`, so a patch of a
file in another encoding survives the round trip `diff()` -> `apply_patch()` byte for byte;
write it back with the same error handler (`agent.records.write_patch` does).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import git

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


def _git(
    cwd: Path,
    *args: str,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
    raw: bool = False,
) -> str | bytes:
    """Run `git <args>` in `cwd`; stdout as text (stripped) or raw bytes; WorkspaceError on failure."""
    exe = git.Git.GIT_PYTHON_GIT_EXECUTABLE or "git"
    cmd = [exe, "--no-optional-locks", "-c", "core.hooksPath=/dev/null", *args]
    runner = git.Git(str(cwd))
    istream = None
    try:
        if stdin is not None:
            istream = tempfile.TemporaryFile()
            istream.write(stdin)
            istream.seek(0)
        out = runner.execute(
            cmd,
            istream=istream,
            env=env,
            stdout_as_string=False,
            strip_newline_in_stdout=False,
        )
    except git.GitCommandError as exc:
        stderr = (exc.stderr or "").strip()
        # GitPython wraps stderr as "\n  stderr: '...'"; keep git's own words
        if stderr.startswith("stderr:"):
            stderr = stderr[len("stderr:"):].strip().strip("'")
        raise WorkspaceError(f"git {' '.join(args[:3])} failed in {cwd}: {stderr or exc}", stderr) from None
    finally:
        if istream is not None:
            istream.close()
    assert isinstance(out, bytes)
    if raw:
        return out
    return out.decode(ENCODING, ERRORS).strip()


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
    try:
        repo = git.Repo(path, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise WorkspaceError(
            f"{path} is not inside a git repository; kloop keeps every accepted change as a commit, "
            f"so the task folder must be in one (e.g. `git init` and commit the task first)"
        ) from None
    if repo.bare or repo.working_tree_dir is None:
        raise WorkspaceError(f"{path}: the repository {repo.git_dir} is bare (no working tree)")
    return Path(repo.working_tree_dir).resolve()


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
            shutil.copyfile(real, index)
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

    def export_tree(self, commit: str, dest: Path, subdir: str | None = None) -> Path:
        """Write the files of `commit` (only `subdir`, as the root, when given) into `dest`.

        `dest` must not exist or be empty. Used to build from the trusted base: nothing of the
        working tree is read. Returns `dest`.
        """
        dest = Path(dest).expanduser().resolve()
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise WorkspaceError(f"{dest}: export destination must be a new or empty folder")
        sha = _rev(self.path, commit)
        sub = (subdir or "").strip("/")
        treeish = f"{sha}:{sub}" if sub and sub != "." else f"{sha}^{{tree}}"
        try:
            tree = str(_git(self.path, "rev-parse", "--verify", "--quiet", treeish))
            if _git(self.path, "cat-file", "-t", tree) != "tree":
                raise WorkspaceError("not a tree")
        except WorkspaceError:
            raise WorkspaceError(f"commit {sha[:12]} has no folder {sub!r}") from None
        dest.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="kloop-index-") as tmp:
            env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
            _git(self.path, "read-tree", tree, env=env)
            _git(self.path, "checkout-index", "--all", "--force", f"--prefix={dest}/", env=env)
        return dest


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
