from strop.export_svc.server import main

main()
