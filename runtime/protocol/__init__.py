"""What clients and models exchange, whatever the transport, shared by the server and the
language: request fields checked with errors naming the field (`fields`), sampling fields ->
`SamplingParams` with the server's bounds (`sampling_fields`), and the chat formats: tool
requests and the tool prompt (`tool_requests`), tool-call formats and their parsers
(`tool_formats`), and reasoning output (`reasoning`). It imports only `config`.
"""
