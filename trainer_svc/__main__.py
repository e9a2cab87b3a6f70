from strop.trainer_svc.server import main

main()
