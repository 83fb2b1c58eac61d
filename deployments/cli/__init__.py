"""`orca-serve`, the command-line client of a running server: `main` parses the command
line, `http` holds the transport and error plumbing every command shares, `chat` and
`batch` are the commands, `batch_input` reads and checks what `batch` submits."""
