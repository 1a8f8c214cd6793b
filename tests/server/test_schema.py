"""The server's OpenAPI schema says what it answers (errors in the shape of each API: OpenAI's, Anthropic's,
Ollama's; server-sent events and newline-delimited JSON), and schemathesis holds the server to it over every
route: no 5xx, every status, media type and body as documented."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from app.hub.convert import ConvertSettings, convert
from app.server.app import create_app
from app.server.http import HttpLimits
from app.service.local import EngineService, LoadOptions
from support.live_server import LiveServer
from support.tiny_chat import tiny_moe

CTX = 128
KEY = "schema-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    src = tiny_moe(tmp_path_factory.mktemp("moe"))
    container = convert(src, tmp_path_factory.mktemp("c") / "tiny", ConvertSettings(bits=4), log=lambda m: None)
    service = EngineService(max_queue=2)
    service.load_and_wait(container, LoadOptions(context_length=CTX, max_batch=2))
    live = LiveServer(create_app(service, api_key=KEY, max_body=64 * 1024), HttpLimits(max_connections=32))
    # One whole answer first, however long the kernels take to compile into a cold numba cache: the fuzzed
    # requests below each have a minute, which is for answering, not compiling.
    warm = httpx.post(live.url + "/v1/completions", headers=AUTH, timeout=900,
                      json={"model": "tiny", "prompt": "warm", "max_tokens": CTX // 2})
    assert warm.status_code == 200, warm.text
    yield live
    live.stop()
    service.close()


@pytest.fixture(scope="module")
def openapi(server) -> dict:
    r = httpx.get(server.url + "/openapi.json", headers=AUTH)
    assert r.status_code == 200
    return r.json()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_completion_routes_document_their_errors_and_events(openapi, path):
    answers = openapi["paths"][path]["post"]["responses"]
    for status in ("400", "401", "404", "413", "429"):
        schema = answers[status]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/ErrorBody"}, status
    assert "422" not in answers           # validation errors are answered 400, in OpenAI's shape
    assert set(answers["200"]["content"]) == {"application/json", "text/event-stream"}
    error = openapi["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path, body, streamed", [
    ("/v1/messages", "AnthropicErrorBody", "text/event-stream"), ("/v1/messages/count_tokens", "AnthropicErrorBody", None),
    ("/api/chat", "OllamaErrorBody", "application/x-ndjson"), ("/api/generate", "OllamaErrorBody", "application/x-ndjson"),
    ("/api/show", "OllamaErrorBody", None)])
def test_the_anthropic_and_ollama_routes_document_their_own_error_shapes(openapi, path, body, streamed):
    answers = openapi["paths"][path]["post"]["responses"]
    for status in ("400", "401", "404", "413", "default"):
        assert answers[status]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{body}"}
    assert "422" not in answers
    if streamed:
        assert set(answers["200"]["content"]) == {"application/json", streamed}
    schemas = openapi["components"]["schemas"]
    assert schemas["OllamaErrorBody"]["properties"]["error"]["type"] == "string"
    assert set(schemas["AnthropicErrorBody"]["required"]) == {"type", "error"}


def test_every_route_documents_its_errors(openapi):
    for path, operations in openapi["paths"].items():
        for method, operation in operations.items():
            answers = operation["responses"]
            assert "default" in answers and "422" not in answers, (method, path)
            if path != "/health":
                assert "401" in answers, (method, path)      # with --api-key
    assert "404" in openapi["paths"]["/v1/atlas"]["get"]["responses"]
    assert "text/event-stream" in openapi["paths"]["/v1/telemetry"]["get"]["responses"]["200"]["content"]
    assert "text/plain" in openapi["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.mark.slow
def test_schemathesis_over_every_route(server, openapi):
    """Schema-valid and schema-breaking requests on every route (but /v1/telemetry, a stream that never ends:
    test_server reads it): none gets a 5xx, each answer conforms to the schema, and broken data is refused."""
    schema = schemathesis.openapi.from_dict(openapi)
    operations = [result.ok() for result in schema.get_all_operations()]
    ran = []
    for operation in operations:
        if operation.path == "/v1/telemetry":
            continue
        examples = 30 if operation.method.upper() == "POST" else 4
        described = openapi["paths"][operation.path][operation.method.lower()]
        takes_input = "requestBody" in described or "parameters" in described
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if takes_input else (GenerationMode.POSITIVE,):
            statuses = _fuzz(server, operation, mode, examples)
            ran.append((operation.method.upper(), operation.path, mode.value))
            if operation.method.upper() == "POST":      # the generator reaches past validation, and is refused
                assert 400 in statuses and (mode is GenerationMode.NEGATIVE or 200 in statuses), statuses
    assert {(method, path) for method, path, _ in ran} == {(op.method.upper(), op.path) for op in operations
                                                            if op.path != "/v1/telemetry"}
    assert {path for _, path, mode in ran if mode == "negative"} == {      # the routes that take a body
        "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/api/chat",
        "/api/generate", "/api/show"}
    assert httpx.get(server.url + "/health").status_code == 200


def _fuzz(server, operation, mode, examples: int) -> list[int]:
    """Statuses of `examples` generated requests to `operation`, each checked."""
    statuses: list[int] = []
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and len(statuses) % 2:
            case.body["model"] = "tiny"     # else nearly every valid body names an unknown model: 404
        statuses.append(case.call_and_validate(base_url=server.url, headers=AUTH, checks=checks, timeout=60).status_code)

    run()
    return statuses
