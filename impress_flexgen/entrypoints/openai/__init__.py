"""The OpenAI-compatible server (`python -m impress_flexgen.serve`).

    server.py    the command line, the listening socket, the service's life
    app.py       the routes: completions, chat completions, tokenize, models, metrics
    protocol.py  the request bodies and answers in OpenAI's shapes
    guard.py     the body-size limit, tenants by API key and cache salt, the server options
    http.py      uvicorn's protocol and server with the connection hygiene it leaves out
"""
