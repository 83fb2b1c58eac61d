"""Fine-tuning jobs, shaped like OpenAI's: POST and GET /v1/files (multipart, purpose
"fine-tune"), GET and DELETE /v1/files/{id}, GET /v1/files/{id}/content;
POST /v1/fine_tuning/jobs, GET /v1/fine_tuning/jobs[/{id}[/events]],
POST /v1/fine_tuning/jobs/{id}/cancel. Files and
jobs live in the scheduler actor (every replica sees the same); the training file is checked
and tokenized here, where the tokenizer is, when a job is created. Jobs run in the GPU's
idle time (engine_actors/finetune_jobs.py) and their adapters are served under
`fine_tuned_model`."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deployments.frontend import Frontend, refusal_error
from deployments.list_params import query_limit, query_order
from deployments.protocol import APIError, _Base
from deployments.request_body import check_unicode
from deployments.training_data import parse_training_file
from engine_actors.finetune_jobs import MAX_FILE_BYTES
from engine_actors.lora_files import TARGETS

DEFAULT_LEARNING_RATE = 2e-4  # learning_rate_multiplier 1 (a common LoRA rate)
FORM_OVERHEAD_BYTES = 1 << 16  # a multipart body's parts besides the file: boundaries, purpose


class Hyperparameters(_Base):
    n_epochs: Annotated[int, Field(le=50)] | Literal["auto"] = "auto"  # OpenAI's bounds
    batch_size: Annotated[int, Field(le=256)] | Literal["auto"] = "auto"
    learning_rate_multiplier: Annotated[float, Field(gt=0, le=1000)] | Literal["auto"] = "auto"
    learning_rate: float | None = Field(default=None, gt=0, le=1)  # extension: the rate itself


class SupervisedMethod(_Base):
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)


class Method(_Base):
    """OpenAI's `method`: only supervised fine-tuning runs here (dpo and reinforcement
    are refused by name)."""
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: SupervisedMethod = Field(default_factory=SupervisedMethod)


class LoRASpec(_Base):
    r: int = Field(default=8, ge=1)
    alpha: float | None = Field(default=None, gt=0, le=1e4)
    target_modules: Annotated[list[Literal[TARGETS]], Field(min_length=1)] | \
        Literal["all-linear"] = "all-linear"


class FineTuningJobRequest(_Base):
    training_file: str
    model: str
    # part of the model's name: no ':' (its separator), '/' or '\\' (a path's), whitespace
    # or control characters
    suffix: str | None = Field(default=None, max_length=64,
                               pattern=r"^[^:/\\\s\x00-\x1f\x7f]*$")
    seed: int = Field(default=0, ge=-2**63, lt=2**63)  # a torch generator's seed
    method: Method | None = None
    hyperparameters: Hyperparameters | None = None  # deprecated by OpenAI for `method`
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)],
                             Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    validation_file: str | None = None  # refused: no validation passes here
    integrations: list[Any] | None = None  # refused: no Weights & Biases here
    lora: LoRASpec = Field(default_factory=LoRASpec)  # extension: the adapter's shape

    @property
    def hyper(self) -> Hyperparameters:
        if self.method is not None:
            return self.method.supervised.hyperparameters
        return self.hyperparameters or Hyperparameters()

    def check_supported(self) -> None:
        if self.method is not None and self.method.type != "supervised":
            raise APIError(400, f"method.type {self.method.type!r} is not supported: this "
                                "server runs supervised LoRA fine-tuning", "method.type",
                           "unsupported_value")
        if self.method is not None and self.hyperparameters is not None:
            raise APIError(400, "give the hyperparameters in method.supervised.hyperparameters "
                                "or in hyperparameters, not both", "hyperparameters",
                           "invalid_value")
        if self.validation_file is not None:
            raise APIError(400, "validation_file is not supported by this server (it computes "
                                "no validation loss); leave it out", "validation_file",
                           "unsupported_parameter")
        if self.integrations:
            raise APIError(400, "integrations are not supported by this server; follow the "
                                "job's loss in its events", "integrations",
                           "unsupported_parameter")
        h, prefix = self.hyper, "method.supervised.hyperparameters" if self.method \
            else "hyperparameters"
        for name in ("n_epochs", "batch_size"):
            if getattr(h, name) != "auto" and getattr(h, name) < 1:
                raise APIError(400, f"{prefix}.{name} must be at least 1",
                               f"{prefix}.{name}", "invalid_value")
        if h.learning_rate is not None and h.learning_rate_multiplier != "auto":
            raise APIError(400, "give learning_rate or learning_rate_multiplier, not both",
                           f"{prefix}.learning_rate", "invalid_value")

    def spec(self, examples: list) -> dict:
        h, lora = self.hyper, self.lora
        multiplier = 1.0 if h.learning_rate_multiplier == "auto" else h.learning_rate_multiplier
        rate = h.learning_rate or DEFAULT_LEARNING_RATE * multiplier
        targets = list(TARGETS) if lora.target_modules == "all-linear" else lora.target_modules
        return {"model": self.model, "training_file": self.training_file,
                "examples": examples, "suffix": self.suffix, "seed": self.seed,
                "metadata": self.metadata,
                "n_epochs": 3 if h.n_epochs == "auto" else h.n_epochs,
                "batch_size": min(8, len(examples)) if h.batch_size == "auto" else h.batch_size,
                "learning_rate": rate,
                "learning_rate_multiplier": rate / DEFAULT_LEARNING_RATE,
                "lora": {"r": lora.r, "alpha": lora.alpha or 2 * lora.r,
                         "target_modules": targets}}


def _metadata(request: Request) -> dict | str | None:
    """OpenAI's filter of a list of jobs by metadata: `metadata[k]=v` for each key that
    must have that value, or `metadata=null` ("null": jobs without metadata; None: no
    filter)."""
    if request.query_params.get("metadata") == "null":
        return "null"
    return {k[len("metadata["):-1]: v for k, v in request.query_params.items()
            if k.startswith("metadata[") and k.endswith("]")} or None


def _listed(out) -> JSONResponse:
    """The scheduler actor's answer, or the error of its refusal."""
    if not isinstance(out, dict):
        raise refusal_error(out.code, out.message)
    return JSONResponse(out)


def _file_too_large() -> APIError:
    return APIError(413, f"file over {MAX_FILE_BYTES} bytes", "file", "file_too_large")


def _not_found(kind: str, name: str, param: str | None = None) -> APIError:
    return APIError(404, f"No such {kind}: {name}", param, "not_found", "not_found_error")


class FineTuningAPI:
    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        self.cfg = frontend.cfg

    def routes(self) -> list[Route]:
        jobs = "/v1/fine_tuning/jobs"
        return [Route("/v1/files", self.upload, methods=["POST"]),
                Route("/v1/files", self.list_files, methods=["GET"]),
                Route("/v1/files/{file_id}", self.file, methods=["GET"]),
                Route("/v1/files/{file_id}/content", self.file_content, methods=["GET"]),
                Route("/v1/files/{file_id}", self.delete_file, methods=["DELETE"]),
                Route(jobs, self.create, methods=["POST"]),
                Route(jobs, self.list_jobs, methods=["GET"]),
                Route(jobs + "/{job_id}", self.job, methods=["GET"]),
                Route(jobs + "/{job_id}/events", self.events, methods=["GET"]),
                Route(jobs + "/{job_id}/cancel", self.cancel, methods=["POST"])]

    def _check_enabled(self) -> None:
        if not self.cfg.enable_finetuning:
            raise APIError(400, "fine-tuning is not enabled on this server (start it with "
                                "enable_finetuning: true)", None, "finetuning_disabled")

    async def _call(self, method: str, *args):
        self._check_enabled()
        self.frontend.refuse_if_draining()
        await self.frontend.ready()
        return await self.frontend.call("finetune_call", method, *args)

    async def upload(self, request: Request):
        try:
            self._check_enabled()
            size = request.headers.get("content-length", "")
            if size.isdigit() and int(size) > MAX_FILE_BYTES + FORM_OVERHEAD_BYTES:
                raise _file_too_large()  # before the body is read (files spool to disk)
            try:
                form = await request.form(max_files=1, max_part_size=MAX_FILE_BYTES)
            except ClientDisconnect:
                raise
            except Exception as e:
                raise APIError(400, f"expected a multipart/form-data body: {e}") from None
            upload, purpose = form.get("file"), form.get("purpose")
            if purpose != "fine-tune":
                raise APIError(400, "purpose must be \"fine-tune\" (the only files this "
                                    "server keeps)", "purpose", "invalid_value")
            if upload is None or isinstance(upload, str):
                raise APIError(400, "file: a file part is required", "file",
                               "missing_required_parameter")
            check_unicode([upload.filename or ""])  # a part's charset may make a surrogate
            content = await upload.read()
            if len(content) > MAX_FILE_BYTES:
                raise _file_too_large()
            meta = await self._call("add_file", upload.filename or "upload.jsonl", purpose,
                                    content)
            if not isinstance(meta, dict):
                raise APIError(413, meta.message, "file", meta.code)
            return JSONResponse(meta)
        except APIError as e:
            return e.response()

    async def list_files(self, request: Request):
        query = request.query_params
        try:
            return _listed(await self._call("list_files", query.get("after"),
                                            query_limit(query, 10_000, 10_000),
                                            query_order(query), query.get("purpose")))
        except APIError as e:
            return e.response()

    async def file(self, request: Request):
        return await self._file(request, "file")

    async def file_content(self, request: Request):
        file_id = request.path_params["file_id"]
        try:
            content = await self._call("file", file_id, True)
            if content is None:
                raise _not_found("file", file_id)
            return Response(content, media_type="application/octet-stream")
        except APIError as e:
            return e.response()

    async def delete_file(self, request: Request):
        return await self._file(request, "delete_file")

    async def _file(self, request: Request, method: str):
        file_id = request.path_params["file_id"]
        try:
            out = await self._call(method, file_id)
            if out is None:
                raise _not_found("file", file_id)
            return JSONResponse(out)
        except APIError as e:
            return e.response()

    async def create(self, request: Request):
        try:
            req = await self.frontend.parse(request, FineTuningJobRequest)
            if req.model not in self.cfg.model_names:
                raise APIError(404, f"The model `{req.model}` does not exist or cannot be "
                               f"fine-tuned here; this server fine-tunes `{self.cfg.model_name}`",
                               "model", "model_not_found")
            content = await self._call("file", req.training_file, True)
            if content is None:
                raise APIError(400, f"No such file: {req.training_file}", "training_file",
                               "file_not_found")
            info = await self.frontend.ready()
            limit = min(info.max_model_len, self.cfg.finetune_max_tokens)
            # a large file takes seconds: it is parsed off the event loop
            examples = await self.frontend.tokenize(
                lambda t: parse_training_file(content, t, limit), len(content), "training")
            job = await self._call("create", req.spec(examples))
            if not isinstance(job, dict):
                raise refusal_error(job.code, job.message, "lora.r")
            return JSONResponse(job)
        except APIError as e:
            return e.response()

    async def list_jobs(self, request: Request):
        query = request.query_params
        try:
            return _listed(await self._call("list_jobs", query.get("after"), query_limit(query),
                                            _metadata(request)))
        except APIError as e:
            return e.response()

    async def job(self, request: Request):
        return await self._one(request, "job")

    async def events(self, request: Request):
        query = request.query_params
        try:
            page = (query.get("after"), query_limit(query))
        except APIError as e:
            return e.response()
        return await self._one(request, "events", *page)

    async def cancel(self, request: Request):
        return await self._one(request, "cancel")

    async def _one(self, request: Request, method: str, *args):
        job_id = request.path_params["job_id"]
        try:
            out = await self._call(method, job_id, *args)
            if out is None:
                raise _not_found("fine-tuning job", job_id)
            return _listed(out)
        except APIError as e:
            return e.response()
