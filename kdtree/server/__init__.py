"""A real SGLang server with `--attention-backend kdtree`, driven from outside: a tiny random-weight
DeepSeek-V3-architecture checkpoint built offline (`checkpoint`), the server's process and its clean-up
(`process`), greedy HTTP requests (`client`), what its log says (`logscan`), and the check that puts them together
(`check`, `kdtree server-check`). Nothing here imports SGLang: the server runs in its own processes."""
