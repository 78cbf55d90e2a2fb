from jointrl.envs.base import ToolCall, ToolSpec, validate_call

TOOLS = [ToolSpec("bash", "", {"type": "object", "properties": {"command": {"type": "string"},
                                                                  "timeout": {"type": "integer"}},
                               "required": ["command"]})]


def test_validate_call_names_the_problem():
    assert validate_call(ToolCall("bash", {"command": "ls"}), TOOLS) is None
    assert "unknown tool 'rm'" in validate_call(ToolCall("rm", {}), TOOLS)
    assert "missing required argument(s) ['command']" in validate_call(ToolCall("bash", {}), TOOLS)
    assert "'command' must be string" in validate_call(ToolCall("bash", {"command": 3}), TOOLS)
    assert "'timeout' must be integer" in validate_call(ToolCall("bash", {"command": "ls", "timeout": True}), TOOLS)
    assert "unknown argument 'cwd'" in validate_call(ToolCall("bash", {"command": "ls", "cwd": "/"}), TOOLS)
