from assistant.cli import main

main(prog_name="assistant")
