"""One-shot HTTP calls for the test suites and dev tools: httpx's module functions (`get`, `post`, `stream`, ...), same
signatures, with one SSL context shared by every call.

httpx's module functions make a Client per call, and each Client loads the CA bundle into a new SSL context,
even for an http:// URL: 41 ms of CPU on the 2-core CI machine, against 0.6 ms with a context given. The suites
poll engines and gateways this way several times a second, beside the engines they test.
"""

from __future__ import annotations

import functools

import httpx

SSL_CONTEXT = httpx.create_ssl_context()

get = functools.partial(httpx.get, verify=SSL_CONTEXT)
post = functools.partial(httpx.post, verify=SSL_CONTEXT)
put = functools.partial(httpx.put, verify=SSL_CONTEXT)
delete = functools.partial(httpx.delete, verify=SSL_CONTEXT)
request = functools.partial(httpx.request, verify=SSL_CONTEXT)
stream = functools.partial(httpx.stream, verify=SSL_CONTEXT)
