from pipeplan.cli import main

main()
