from cachemgr.cli.main import main

main()
