"""``/admin/builds`` and ``/admin/pulls``: background builds and registry pulls, and their progress."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, get, post
from litestar.params import PathParameter

from cachesvc.cache.profiles import ProfileRequest
from cachesvc.http.admin.params import Manager, ModelRoots, StrictBody
from cachesvc.http.errors import problem_responses
from cachesvc.http.schemas import BuildListOut, BuildOut, BuildRequest, PullRequest, to_body

BuildId = Annotated[
    str, PathParameter(min_length=1, max_length=128, description="Build id from POST /admin/builds")
]
PullId = Annotated[
    str, PathParameter(min_length=1, max_length=128, description="Pull id from POST /admin/pulls")
]


class BuildController(Controller):
    """``/admin/builds``: prepare profiles ahead of time and watch their progress."""

    path = "/builds"
    tags = ["builds"]

    @post(
        "/",
        status_code=202,
        sync_to_thread=True,
        operation_id="startBuild",
        responses=problem_responses(400, 404, 409, 415, 502, 507),
    )
    def start_build(
        self, manager: Manager, model_roots: ModelRoots, data: Annotated[BuildRequest, StrictBody]
    ) -> BuildOut:
        """Start a background build (or join the running one for the same bundle)."""
        request = _profile(data)
        return to_body(manager.start_build(data.model, request, allowed_roots=model_roots), BuildOut)

    @get("/", sync_to_thread=True, operation_id="listBuilds", responses=problem_responses())
    def list_builds(self, manager: Manager) -> BuildListOut:
        """Every build this server started, newest first."""
        return to_body({"items": manager.builds.all_builds()}, BuildListOut)

    @get(
        "/{build_id:str}", sync_to_thread=True, operation_id="getBuild", responses=problem_responses(400, 404)
    )
    def get_build(self, manager: Manager, build_id: BuildId) -> BuildOut:
        """State, stage, elapsed time, bytes written and error of one build."""
        return to_body(manager.builds.get(build_id), BuildOut)


class PullController(Controller):
    """``/admin/pulls``: pull bundles from the OCI registry in the background (no build)."""

    path = "/pulls"
    tags = ["registry"]

    @post(
        "/",
        status_code=202,
        sync_to_thread=True,
        operation_id="startPull",
        responses=problem_responses(400, 404, 409, 415),
    )
    def start_pull(
        self, manager: Manager, model_roots: ModelRoots, data: Annotated[PullRequest, StrictBody]
    ) -> BuildOut:
        """Queue a pull of the bundle of ``model`` and the profile for this node from the
        registry (``ref``, default ``--registry``); its state and error as a build's."""
        job = manager.start_pull(data.model, _profile(data), ref=data.ref, allowed_roots=model_roots)
        return to_body(job, BuildOut)

    @get("/", sync_to_thread=True, operation_id="listPulls", responses=problem_responses())
    def list_pulls(self, manager: Manager) -> BuildListOut:
        """Every pull this server started, newest first."""
        return to_body({"items": manager.pulls.all_builds()}, BuildListOut)

    @get("/{pull_id:str}", sync_to_thread=True, operation_id="getPull", responses=problem_responses(400, 404))
    def get_pull(self, manager: Manager, pull_id: PullId) -> BuildOut:
        """State, stage and error of one pull."""
        return to_body(manager.pulls.get(pull_id), BuildOut)


def _profile(data: BuildRequest) -> ProfileRequest:
    """The build profile a build or pull request names."""
    return ProfileRequest(
        backend=data.backend,
        precision=data.precision,
        max_input_len=data.max_input_len,
        max_batch_size=data.max_batch_size,
        max_kv_cache_capacity=data.max_kv_cache_capacity,
        speculative_method=data.speculative_method,
        draft_model=data.draft_model,
        task=data.task,
        pooling=data.pooling,
        lora=data.lora,
        kernels=data.kernels,
        kv_cache_dtype=data.kv_cache_dtype,
        max_image_tokens=data.max_image_tokens,
        max_image_tokens_per_image=data.max_image_tokens_per_image,
    )
