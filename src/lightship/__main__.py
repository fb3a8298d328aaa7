from lightship.cli import main

main()
