"""A local DynamoDB stand-in for the tests: moto's server, one request at a time.

moto's own server handles requests on many threads, and its DynamoDB checks a write's
condition and applies the write as separate Python steps, so two racing conditional writes
can both pass. DynamoDB applies each conditional write atomically; serving one request at a
time keeps that true here (connections stay open and concurrent; their requests queue). The
HTTP/1.1 server below is a small one of our own on one asyncio loop: moto's app answers each
request in turn, with no thread per connection.

moto keeps its tables in memory. With IDEMPOTENCY_DYNAMODB_JOURNAL set to a file, every
write it applied (a 2xx answer) is appended to that file and synced before it is answered,
and a server started on an existing journal replays it first: a stand-in killed and started
again keeps what it acknowledged, as DynamoDB does. (Replaying gives the same tables: the
store's conditions compare numbers its client sent, never moto's clock.)

Usage: python dynamodb-local.py HOST PORT
"""

import asyncio
import base64
import collections
import copy
import functools
import io
import json
import os
import sys
import threading
import traceback

from moto.dynamodb.comparisons import ConditionExpressionParser
from moto.dynamodb.parsing.expressions import UpdateExpressionParser
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.test import EnvironBuilder

host, port = sys.argv[1], int(sys.argv[2])
dispatcher = DomainDispatcherApplication(create_backend_app)
one_at_a_time = threading.Lock()

# Speed, not behaviour. Most of moto's time per request goes to finding the service for the
# host among all of its modules, and to parsing the same few expressions again and again:
# - DynamoDB requests (X-Amz-Target DynamoDB_20120810.*) go straight to the app moto's own
#   dispatcher chose for the first of them; anything else goes through the dispatcher.
# - A parsed update expression, and a lexed condition expression, depend only on the
#   expression's text: each is kept by text and handed out as a deep copy (moto rewrites the
#   tree when it substitutes values). Errors are not kept: a bad expression raises each time.
DYNAMODB_TARGET = "DynamoDB_20120810."
dynamodb_app = None


def app(environ, start_response):
    global dynamodb_app
    if environ.get("HTTP_X_AMZ_TARGET", "").startswith(DYNAMODB_TARGET):
        if dynamodb_app is None:
            dynamodb_app = dispatcher.get_application(environ)
        return dynamodb_app(environ, start_response)
    return dispatcher(environ, start_response)


_parse_update = UpdateExpressionParser.make.__func__


@functools.lru_cache(maxsize=512)
def _parsed_update(cls, expression):
    return _parse_update(cls, expression)


UpdateExpressionParser.make = classmethod(
    lambda cls, expression: copy.deepcopy(_parsed_update(cls, expression))
)

_lex_condition = ConditionExpressionParser._lex_condition_expression


@functools.lru_cache(maxsize=512)
def _lexed_condition(expression):
    parser = ConditionExpressionParser.__new__(ConditionExpressionParser)
    parser.condition_expression = expression
    return tuple(_lex_condition(parser))


ConditionExpressionParser._lex_condition_expression = lambda self: copy.deepcopy(
    collections.deque(_lexed_condition(self.condition_expression))
)


WRITES = {
    "PutItem", "UpdateItem", "DeleteItem", "TransactWriteItems", "BatchWriteItem",
    "CreateTable", "DeleteTable", "UpdateTable", "UpdateTimeToLive",
}
KEPT_HEADERS = ("X-Amz-Target", "Content-Type", "Authorization", "Host")
journal_path = os.environ.get("IDEMPOTENCY_DYNAMODB_JOURNAL")
journal = None


def call(environ, start_response):
    body = app(environ, start_response)
    try:
        return b"".join(body)
    finally:
        if hasattr(body, "close"):
            body.close()


def replay(path):
    replayed, good = 0, 0
    with open(path, "rb") as f:
        for line in f:
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("cut short")
                entry = json.loads(line)
            except ValueError:
                break  # a line a crash cut short: its write was never acknowledged
            good += len(line)
            environ = EnvironBuilder(
                method="POST", path="/", headers=entry["headers"],
                data=base64.b64decode(entry["body"]),
            ).get_environ()
            call(environ, lambda status, headers, exc_info=None: None)
            replayed += 1
    os.truncate(path, good)
    print(f"replayed {replayed} writes from {path}", file=sys.stderr, flush=True)


def serialised(environ, start_response):
    length = int(environ.get("CONTENT_LENGTH") or 0)
    request = environ["wsgi.input"].read(length) if length else b""
    environ["wsgi.input"] = io.BytesIO(request)
    target = environ.get("HTTP_X_AMZ_TARGET", "").rsplit(".", 1)[-1]
    answered = []

    def record_status(status, headers, exc_info=None):
        answered.append(status)
        return start_response(status, headers, exc_info)

    with one_at_a_time:
        response = call(environ, record_status)
        if journal is not None and target in WRITES and answered and answered[0].startswith("2"):
            headers = {}
            for name in KEPT_HEADERS:
                value = environ.get("HTTP_" + name.upper().replace("-", "_"))
                if name == "Content-Type":
                    value = environ.get("CONTENT_TYPE", value)
                if value is not None:
                    headers[name] = value
            entry = {"headers": headers, "body": base64.b64encode(request).decode()}
            journal.write((json.dumps(entry) + "\n").encode())
            journal.flush()
            os.fsync(journal.fileno())
        return [response]


if journal_path:
    if os.path.exists(journal_path):
        replay(journal_path)
    journal = open(journal_path, "ab")

# The HTTP server: one thread, one asyncio loop, HTTP/1.1 keep-alive. Requests are handled one
# at a time by construction (the lock above is then never contended); werkzeug's threaded
# server spent more of moto's time starting threads, handing the interpreter lock between
# them and writing responses in pieces than moto spent answering.


def environ_for(method, target, version, headers, body, peer):
    path, _, query = target.partition("?")
    environ = {
        "REQUEST_METHOD": method,
        "SCRIPT_NAME": "",
        "PATH_INFO": path,
        "QUERY_STRING": query,
        "SERVER_NAME": host,
        "SERVER_PORT": str(port),
        "SERVER_PROTOCOL": version,
        "REMOTE_ADDR": peer,
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": False,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
        "CONTENT_LENGTH": str(len(body)),
    }
    for name, value in headers:
        key = name.upper().replace("-", "_")
        if key == "CONTENT_TYPE":
            environ["CONTENT_TYPE"] = value
        elif key != "CONTENT_LENGTH":
            key = "HTTP_" + key
            environ[key] = environ[key] + "," + value if key in environ else value
    return environ


async def answer_and_close(writer, status):
    writer.write(f"HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                 .encode("latin-1"))
    await writer.drain()


async def connection(reader, writer):
    peer = (writer.get_extra_info("peername") or ("127.0.0.1",))[0]
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            try:
                lines = head.decode("latin-1").split("\r\n")
                method, target, version = lines[0].split(" ", 2)
                headers = []
                for line in lines[1:]:
                    if line:
                        name, _, value = line.partition(":")
                        headers.append((name.strip(), value.strip()))
                fields = {name.lower(): value for name, value in headers}
                length = int(fields.get("content-length") or 0)
            except ValueError:
                await answer_and_close(writer, "400 Bad Request")
                return
            if "chunked" in fields.get("transfer-encoding", "").lower():
                await answer_and_close(writer, "501 Not Implemented")
                return
            if fields.get("expect", "").lower() == "100-continue":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            try:
                body = await reader.readexactly(length) if length else b""
            except asyncio.IncompleteReadError:
                return
            close = fields.get("connection", "").lower() == "close" or version != "HTTP/1.1"
            answer = []

            def start_response(status, response_headers, exc_info=None):
                answer[:] = [status, response_headers]

            try:
                response = b"".join(serialised(
                    environ_for(method, target, version, headers, body, peer),
                    start_response))
                status, response_headers = answer
            except Exception:
                traceback.print_exc()
                await answer_and_close(writer, "500 Internal Server Error")
                return
            out = ["HTTP/1.1 ", status, "\r\n"]
            for name, value in response_headers:
                if name.lower() not in ("content-length", "connection", "transfer-encoding"):
                    out += [name, ": ", value, "\r\n"]
            out += ["Content-Length: ", str(len(response)), "\r\n"]
            if close:
                out.append("Connection: close\r\n")
            out.append("\r\n")
            writer.write("".join(out).encode("latin-1") + response)
            await writer.drain()
            if close:
                return
    except ConnectionError:
        return
    finally:
        writer.close()


async def serve():
    server = await asyncio.start_server(connection, host, port, limit=1 << 20, backlog=256)
    print(f" * Running on http://{host}:{port}", file=sys.stderr, flush=True)
    async with server:
        await server.serve_forever()


asyncio.run(serve())
