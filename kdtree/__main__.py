from kdtree.cli import main

main()
