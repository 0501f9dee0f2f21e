"""A local DynamoDB stand-in for the tests: moto's server, one request at a time.

moto's own server handles requests on many threads, and its DynamoDB checks a write's
condition and applies the write as separate Python steps, so two racing conditional writes
can both pass. DynamoDB applies each conditional write atomically; serving one request at a
time keeps that true here (connections stay open and concurrent; their requests queue).

Usage: python dynamodb-local.py HOST PORT
"""

import sys
import threading

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import run_simple

host, port = sys.argv[1], int(sys.argv[2])
app = DomainDispatcherApplication(create_backend_app)
one_at_a_time = threading.Lock()


def serialised(environ, start_response):
    with one_at_a_time:
        body = app(environ, start_response)
        try:
            return [b"".join(body)]
        finally:
            if hasattr(body, "close"):
                body.close()


run_simple(host, port, serialised, threaded=True)
